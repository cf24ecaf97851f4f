"""The GPU check: a prepared run on one CUDA host, a few minutes long, not part of CI.

    python -m lynx.tools.gpu_check                              # every step
    python -m lynx.tools.gpu_check --steps bytes,throughput --peak-gbps 3350
    python -m lynx.tools.gpu_check --plan                       # what would run; no CUDA touched

(``scripts/gpu_check.sh`` installs the repo with its ``cuda`` extra first.) Steps, run in
this order, each selectable with ``--steps``:

* ``codec``: ``pytest test/unit/test_codec_triton.py`` with TRITON_INTERPRET unset, so the
  Triton kernels run on the GPU against the torch reference;
* ``bytes``: one KV pool segment per codec mode (SmolLM2's shape, seeded, as
  benchmark/codec.py) encoded and decoded by the Triton kernels, the torch reference and
  the C++ codec: the SHA-256 of the Anchor, the Residual, the Anchor-only and the fully
  decoded rows must be the same on every path;
* ``throughput``: encode, Anchor-only decode and full decode of a large segment on the GPU,
  in GB/s of bytes moved (read + written) and as a fraction of the GPU's peak memory
  bandwidth (``--peak-gbps``, else a table of known GPUs, else "unknown");
* ``pd``: a prefill and a decode server sharing the GPU (``--mem-fraction-static`` each),
  KV over Mooncake (RDMA where the host has a device, else TCP), run as plain PD, then
  Lynx ``full``, then Lynx ``speculative``, both with the exact residual (so their greedy
  output must equal plain PD's token for token; an INT8 residual may differ by design);
  the speculative servers hold the Residual back ``--residual-hold`` seconds so that tokens
  are held and verified. Per configuration: outputs equal to plain PD's, median TTFT.

Prints one summary table and writes JSON (``--out``): every step's status (ok, failed or
skipped) with its reason and figures. Exit status: 0 every selected step ok; 1 a step
failed or was not run; 2 a usage error; 3 no CUDA device (every step skipped). Steps start
only while ``--budget-s`` lasts; a server start waits at most what is left of it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from lynx.tools.cluster import (
    ClusterError,
    ServerConfig,
    SingleServer,
    free_port,
    pd_body,
    pd_generate,
    running,
    terminate_on_sigterm,
)

STEPS = ("codec", "bytes", "throughput", "pd")
DISTRIBUTIONS = (
    "torch",
    "triton",
    "sglang",
    "sglang-router",
    "mooncake-transfer-engine",  # the CUDA/RDMA build (extra cuda)
    "mooncake-transfer-engine-non-cuda",  # the TCP build (extra cpu): should be absent here
)
SCHEMA = 1
DEFAULT_OUT = Path("benchmark/results/gpu_check.json")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_CUDA = 0, 1, 2, 3
CODEC_TEST = Path("test/unit/test_codec_triton.py")
RDMA_ROOT = Path("/sys/class/infiniband")

Status = Literal["ok", "failed", "skipped", "planned"]

# Peak memory bandwidth in GB/s by torch.cuda.get_device_name(), first match wins. H100 PCIe
# and NVL and the A100 80GB PCIe card have other figures: they are "unknown" here.
PEAK_GBPS: tuple[tuple[str, str, float], ...] = (
    (r"\bH200\b", "H200", 4800.0),
    (r"\bH100\b(?!.*\b(?:PCIe|NVL)\b)", "H100 SXM", 3350.0),  # "NVIDIA H100 80GB HBM3"
    (r"\bA100\b.*\b80GB\b(?!.*\bPCIe\b)", "A100 80GB", 2039.0),  # "NVIDIA A100-SXM4-80GB"
    (r"\bL40S\b", "L40S", 864.0),
)

THROUGHPUT_MODES = ("b4 keys/ch16 lossless (default)", "b4 keys/ch16 int8")
THROUGHPUT_OPS = ("encode", "decode_anchor", "decode_full")

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time " * 60,  # ~1000 tokens of the tiny model: several 256-token segments
    "1, 2, 3, 4, 5,",
    "In a hole in the ground there lived",
    "Explain in one sentence why the sky is blue:",
)
PD_CONFIGS = ("plain", "full", "speculative")
EXACT = ("--lynx-residual", "exact")
REQUEST_TIMEOUT_S = 120.0
MIN_CONFIG_S = 60.0  # budget left below which a PD configuration is not started


# ---- what a step reports ---------------------------------------------------------------


@dataclass
class Item:
    """One row of the summary table."""

    name: str
    status: Status
    result: str


@dataclass
class StepResult:
    name: str
    status: Status
    reason: str
    seconds: float = 0.0
    items: list[Item] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _overall(items: Sequence[Item]) -> Status:
    return "failed" if any(item.status == "failed" for item in items) else "ok"


# ---- options -------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    steps: tuple[str, ...]
    plan: bool
    out: Path
    peak_gbps: float | None
    repo: Path
    bytes_tokens: int
    throughput_tokens: int
    repeats: int
    model: str
    prompts: int
    max_new_tokens: int
    mem_fraction_static: float
    max_total_tokens: int
    transfer: str
    ib_device: str | None
    residual_hold: float
    server_args: tuple[str, ...]
    log_dir: Path
    budget_s: float

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def _default_repo() -> Path:
    """This module's checkout when it has the codec tests, else the current directory."""
    checkout = Path(__file__).resolve().parents[3]
    return checkout if (checkout / CODEC_TEST).is_file() else Path.cwd()


def _steps(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no step named; choose from {', '.join(STEPS)}")
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown step{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"choose from {', '.join(STEPS)}"
        )
    return tuple(step for step in STEPS if step in names)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lynx.tools.gpu_check",
        description=__doc__.split("\n")[0],
        epilog="Exit status: 0 every selected step ok, 1 a step failed or was not run, 2 usage "
        "error, 3 no CUDA device.",
    )
    parser.add_argument(
        "--steps",
        type=_steps,
        default=STEPS,
        help=f"comma-separated steps to run (default all: {','.join(STEPS)}); they run in that order",
    )
    parser.add_argument(
        "--plan",
        "--dry-run",
        dest="plan",
        action="store_true",
        help="print and write the JSON of what would run, touching no CUDA device",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON report (default {DEFAULT_OUT})")
    parser.add_argument(
        "--peak-gbps",
        type=_positive_float,
        default=None,
        help="the GPU's peak memory bandwidth in GB/s (default: from a table of known GPUs, "
        + ", ".join(f"{label} {gbps:.0f}" for _, label, gbps in PEAK_GBPS)
        + "; else unknown)",
    )
    parser.add_argument(
        "--repo", type=Path, default=None, help=f"the checkout holding {CODEC_TEST} (default: this one)"
    )
    parser.add_argument("--bytes-tokens", type=_positive_int, default=512, help="segment tokens (bytes)")
    parser.add_argument(
        "--throughput-tokens", type=_positive_int, default=16384, help="segment tokens (throughput)"
    )
    parser.add_argument("--repeats", type=_positive_int, default=10, help="timed calls per op (median)")
    parser.add_argument("--model", default="tiny", help="pd: tiny (default), smollm2, or a model folder")
    parser.add_argument(
        "--prompts", type=_positive_int, default=4, help=f"pd: greedy prompts, 1..{len(PROMPTS)} (default 4)"
    )
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32, help="pd: tokens per prompt")
    parser.add_argument(
        "--mem-fraction-static",
        type=_positive_float,
        default=0.35,
        help="pd: each server's --mem-fraction-static (both share the GPU; at most 0.5)",
    )
    parser.add_argument("--max-total-tokens", type=_positive_int, default=16384, help="pd: KV pool tokens")
    parser.add_argument(
        "--transfer",
        choices=("auto", "rdma", "tcp"),
        default="auto",
        help=f"pd: Mooncake's transport (auto: RDMA when {RDMA_ROOT} lists a device, else TCP)",
    )
    parser.add_argument("--ib-device", default=None, help="pd: --disaggregation-ib-device (RDMA only)")
    parser.add_argument(
        "--residual-hold",
        type=float,
        default=0.5,
        help="pd: the speculative servers' --lynx-residual-hold in seconds (0: none; default 0.5)",
    )
    parser.add_argument(
        "--server-args", default="", help='pd: more flags for every server, e.g. "--attention-backend triton"'
    )
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="pd: server logs (default logs/gpu_check-<time>)"
    )
    parser.add_argument(
        "--budget-s",
        type=_positive_float,
        default=450.0,
        help="seconds the steps may take together (default 450); a step is not started after it",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Options:
    """The options, or exit 2 with the parser's message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}, got {args.prompts}")
    if args.mem_fraction_static > 0.5:
        parser.error(
            f"--mem-fraction-static {args.mem_fraction_static}: prefill and decode share the GPU, "
            "each may take at most 0.5"
        )
    if not 0 <= args.residual_hold < 60:
        parser.error(f"--residual-hold must be in [0, 60) seconds, got {args.residual_hold}")
    if args.ib_device is not None and args.transfer == "tcp":
        parser.error("--ib-device names an RDMA device; it does not go with --transfer tcp")
    try:
        server_args = tuple(shlex.split(args.server_args))
    except ValueError as exc:
        parser.error(f"--server-args: {exc}")
    model_folder = args.model not in ("tiny", "smollm2")
    if "pd" in args.steps and model_folder and not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: not tiny, smollm2, or a model folder (no config.json)")
    log_dir = args.log_dir or Path("logs") / f"gpu_check-{datetime.now():%Y%m%d-%H%M%S}"
    return Options(
        steps=args.steps,
        plan=args.plan,
        out=args.out,
        peak_gbps=args.peak_gbps,
        repo=(args.repo or _default_repo()).resolve(),
        bytes_tokens=args.bytes_tokens,
        throughput_tokens=args.throughput_tokens,
        repeats=args.repeats,
        model=args.model,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        mem_fraction_static=args.mem_fraction_static,
        max_total_tokens=args.max_total_tokens,
        transfer="rdma" if args.ib_device is not None else args.transfer,
        ib_device=args.ib_device,
        residual_hold=args.residual_hold,
        server_args=server_args,
        log_dir=log_dir,
        budget_s=args.budget_s,
    )


# ---- the device ------------------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    gbps: float | None
    source: str  # "--peak-gbps", "table: <GPU>" or "unknown"


def peak_bandwidth(device_name: str | None, override: float | None) -> Peak:
    """The peak memory bandwidth to measure against: ``override``, else the table's figure
    for ``device_name``, else unknown."""
    if override is not None:
        return Peak(override, "--peak-gbps")
    for pattern, label, gbps in PEAK_GBPS:
        if device_name and re.search(pattern, device_name):
            return Peak(gbps, f"table: {label}")
    return Peak(None, "unknown")


def cuda_device() -> dict[str, Any] | None:
    """The first CUDA device's facts, or None when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
        "torch_cuda": torch.version.cuda,
    }


def _no_cuda_reason() -> str:
    import torch

    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"torch.cuda.is_available() is False (torch {torch.__version__}, {built}{hint})"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass
class Context:
    options: Options
    peak: Peak
    deadline: float  # time.monotonic()

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


# ---- step: codec ---------------------------------------------------------------------


def codec_command() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CODEC_TEST)]


def plan_codec(options: Options) -> tuple[str, dict[str, Any]]:
    found = (options.repo / CODEC_TEST).is_file()
    return (
        f"pytest {CODEC_TEST} in {options.repo}, TRITON_INTERPRET unset"
        + ("" if found else " (the file is missing there: the step would fail)"),
        {
            "command": codec_command(),
            "cwd": str(options.repo),
            "env": "TRITON_INTERPRET unset: the kernels run on the GPU",
            "test_file_found": found,
        },
    )


_PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def pytest_outcome(returncode: int, stdout: str) -> tuple[bool, str, dict[str, int]]:
    """(passed, summary line, counts) of a ``pytest -q`` run: it passed when pytest exited
    0 and every collected test ran and passed (a skipped test did not run on the GPU)."""
    lines = stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else "(no output)"
    counts: dict[str, int] = {}
    for n, kind in _PYTEST_COUNTS.findall(summary):
        counts["errors" if kind.startswith("error") else kind] = int(n)
    ran_all = counts.get("passed", 0) > 0 and set(counts) == {"passed"}
    return returncode == 0 and ran_all, summary, counts


def step_codec(ctx: Context) -> StepResult:
    options = ctx.options
    if not (options.repo / CODEC_TEST).is_file():
        return StepResult("codec", "failed", f"{CODEC_TEST} not found under {options.repo} (--repo)")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    command = codec_command()
    timeout = max(1.0, min(300.0, ctx.remaining_s()))
    try:
        out = subprocess.run(
            command, cwd=options.repo, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return StepResult("codec", "failed", f"pytest did not finish within {timeout:.0f} s")
    ok, summary, counts = pytest_outcome(out.returncode, out.stdout)
    details: dict[str, Any] = {"command": command, "returncode": out.returncode, "summary": summary, **counts}
    if not ok:
        details["output_tail"] = (out.stdout + out.stderr)[-4000:]
    reason = summary if ok else f"pytest exit {out.returncode}: {summary}"
    return StepResult(
        "codec",
        "ok" if ok else "failed",
        reason,
        items=[Item(str(CODEC_TEST), "ok" if ok else "failed", summary)],
        details=details,
    )


# ---- step: bytes ---------------------------------------------------------------------


BYTES_PATHS = ("cpu-torch", "cpu-cpp", "triton")  # the reference first; cpu-cpp where it builds


def plan_bytes(options: Options) -> tuple[str, dict[str, Any]]:
    from lynx.tools.codec_bench import DIGEST_PARTS, MODES, SMOLLM2_LAYOUT

    return (
        f"{len(MODES)} codec modes x {', '.join(BYTES_PATHS)} on a {options.bytes_tokens}-token segment: "
        "SHA-256 of anchor, residual, decoded rows",
        {
            "layout": str(SMOLLM2_LAYOUT),
            "tokens": options.bytes_tokens,
            "modes": list(MODES),
            "paths": list(BYTES_PATHS),
            "compared": list(DIGEST_PARTS),
        },
    )


def compare_paths(digests: dict[str, dict[str, str]], reference: str = "cpu-torch") -> dict[str, list[str]]:
    """For each path but the reference, the digest parts in which it differs from it."""
    from lynx.tools.codec_bench import differing_parts

    return {
        path: differing_parts(digests[reference], found)
        for path, found in digests.items()
        if path != reference
    }


def step_bytes(ctx: Context) -> StepResult:
    from lynx.codec import cpp_backend
    from lynx.tools.codec_bench import MODES, SMOLLM2_LAYOUT, cpu_backend, make_segment

    tokens = ctx.options.bytes_tokens
    cpp = cpp_backend.available()
    items, modes = [], {}
    for name, config in MODES.items():
        digests: dict[str, dict[str, str]] = {}
        with cpu_backend("reference"):
            digests["cpu-torch"] = make_segment(SMOLLM2_LAYOUT, tokens, config, "cpu").digests()
        if cpp:
            with cpu_backend("cpp"):
                digests["cpu-cpp"] = make_segment(SMOLLM2_LAYOUT, tokens, config, "cpu").digests()
        digests["triton"] = make_segment(SMOLLM2_LAYOUT, tokens, config, "cuda").digests()
        differ = compare_paths(digests)
        bad = {path: parts for path, parts in differ.items() if parts}
        if bad:
            result = "; ".join(
                f"{path} differs from cpu-torch in {', '.join(parts)}" for path, parts in bad.items()
            )
        else:
            result = " = ".join(digests) + ": anchor, residual, decoded rows"
        items.append(Item(name, "failed" if bad else "ok", result))
        modes[name] = {"digests": digests, "differing": differ}
    status = _overall(items)
    failed = [item.name for item in items if item.status == "failed"]
    reason = (
        f"{len(items)} modes, Triton bytes = CPU bytes"
        if status == "ok"
        else f"different bytes in {', '.join(failed)}"
    )
    if not cpp:
        reason += " (C++ codec did not build: compared Triton with the torch reference only)"
    return StepResult(
        "bytes",
        status,
        reason,
        items=items,
        details={"tokens": tokens, "layout": str(SMOLLM2_LAYOUT), "cpp_available": cpp, "modes": modes},
    )


# ---- step: throughput ----------------------------------------------------------------


def plan_throughput(options: Options) -> tuple[str, dict[str, Any]]:
    from lynx.tools.codec_bench import SMOLLM2_LAYOUT

    peak = peak_bandwidth(None, options.peak_gbps)
    peak_text = f"{peak.gbps:g} GB/s (--peak-gbps)" if peak.gbps is not None else "looked up by device name"
    return (
        f"{', '.join(THROUGHPUT_OPS)} of a {options.throughput_tokens}-token segment in "
        f"{len(THROUGHPUT_MODES)} modes, median of {options.repeats}; peak {peak_text}",
        {
            "layout": str(SMOLLM2_LAYOUT),
            "tokens": options.throughput_tokens,
            "modes": list(THROUGHPUT_MODES),
            "ops": list(THROUGHPUT_OPS),
            "repeats": options.repeats,
            "peak_gbps": peak.gbps if peak.gbps is not None else "from the device name at run time",
        },
    )


def moved_nbytes(op: str, input_nbytes: int, anchor_nbytes: int, residual_nbytes: int) -> int:
    """Bytes an op reads and writes: encode reads the rows and writes both halves; decode
    reads the Anchor (and the Residual for a full decode) and writes the rows."""
    if op == "encode":
        return input_nbytes + anchor_nbytes + residual_nbytes
    if op == "decode_anchor":
        return anchor_nbytes + input_nbytes
    if op == "decode_full":
        return anchor_nbytes + residual_nbytes + input_nbytes
    raise ValueError(f"unknown op {op!r}")


def fraction_text(gbps: float, peak: Peak) -> str:
    return "peak unknown" if peak.gbps is None else f"{gbps / peak.gbps:.0%} of peak"


def step_throughput(ctx: Context) -> StepResult:
    from functools import partial

    import torch

    from lynx.tools.codec_bench import MODES, SMOLLM2_LAYOUT, make_segment, timed

    peak, tokens, repeats = ctx.peak, ctx.options.throughput_tokens, ctx.options.repeats
    items, rows = [], []
    for name in THROUGHPUT_MODES:
        segment = make_segment(SMOLLM2_LAYOUT, tokens, MODES[name], "cuda")
        calls = {
            "encode": segment.encode,
            "decode_anchor": partial(segment.decode, with_residual=False),
            "decode_full": segment.decode,
        }
        segment.encode()  # the decodes need an Anchor and a Residual
        row: dict[str, Any] = {"mode": name, "tokens": tokens, "input_bytes": segment.input_nbytes}
        texts = []
        for op in THROUGHPUT_OPS:
            seconds = timed(calls[op], repeats, "cuda")
            moved = moved_nbytes(op, segment.input_nbytes, segment.anchor.numel(), segment.residual.numel())
            gbps = moved / seconds / 1e9
            row[op] = {
                "seconds": seconds,
                "moved_bytes": moved,
                "GBps": gbps,
                "input_GBps": segment.input_nbytes / seconds / 1e9,
                "fraction_of_peak": None if peak.gbps is None else gbps / peak.gbps,
            }
            texts.append(f"{op} {gbps:.0f} GB/s ({fraction_text(gbps, peak)})")
        rows.append(row)
        items.append(Item(name, "ok", ", ".join(texts)))
        del segment, calls
    torch.cuda.empty_cache()  # the pd step's servers share this GPU
    peak_text = "peak unknown" if peak.gbps is None else f"of {peak.gbps:.0f} GB/s peak ({peak.source})"
    encode = rows[0]["encode"]
    reason = (
        f"default mode: encode {encode['GBps']:.0f} GB/s, "
        f"full decode {rows[0]['decode_full']['GBps']:.0f} GB/s moved, {peak_text}"
    )
    return StepResult(
        "throughput",
        "ok",
        reason,
        items=items,
        details={"peak_gbps": peak.gbps, "peak_source": peak.source, "rows": rows},
    )


# ---- step: pd ------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    backend: str  # --disaggregation-transfer-backend
    args: tuple[str, ...]
    why: str


class TransferUnavailable(RuntimeError):
    pass


def rdma_devices(root: Path = RDMA_ROOT) -> list[str]:
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def resolve_transfer(choice: str, ib_device: str | None, root: Path = RDMA_ROOT) -> Transfer:
    """Mooncake over RDMA (``mooncake``; Mooncake's default protocol) when asked for or when
    ``root`` lists a device, else over TCP (``mooncake_tcp``: upstream's mooncake with
    MC_FORCE_TCP=1, what lynx.tools.cluster and docker/.env use)."""
    devices = rdma_devices(root)
    if choice == "tcp" or (choice == "auto" and not devices):
        why = "--transfer tcp" if choice == "tcp" else f"no RDMA device under {root}"
        return Transfer("mooncake_tcp", ("--disaggregation-transfer-backend", "mooncake_tcp"), why)
    if not devices:
        raise TransferUnavailable(f"RDMA asked for but {root} lists no device")
    args: tuple[str, ...] = ("--disaggregation-transfer-backend", "mooncake")
    if ib_device is not None:
        args += ("--disaggregation-ib-device", ib_device)
    return Transfer("mooncake", args, f"RDMA devices: {', '.join(devices)}")


def lynx_flags(config: str, residual_hold: float) -> list[str]:
    """Both servers' flags of one configuration (Lynx needs the same on both sides)."""
    if config == "plain":
        return []
    flags = ["--lynx", "--lynx-mode", config, *EXACT]
    if config == "speculative" and residual_hold > 0:
        flags += ["--lynx-residual-hold", f"{residual_hold:g}"]
    return flags


def server_config(options: Options, model: Path) -> ServerConfig:
    """What both servers of every configuration share: CUDA, half the GPU each at most."""
    return ServerConfig(
        model_path=model,
        cpu=False,
        max_total_tokens=options.max_total_tokens,
        extra_args=["--mem-fraction-static", f"{options.mem_fraction_static:g}", *options.server_args],
        env={"SGLANG_USE_CPU_ENGINE": "0"},
    )


def side_args(
    config: str, side: str, options: Options, transfer: Transfer, bootstrap_port: int | str
) -> list[str]:
    """One server's own flags, after ``server_config``'s."""
    args = [*lynx_flags(config, options.residual_hold), *transfer.args, "--disaggregation-mode", side]
    if side == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return args


def server_commands(options: Options, transfer: Transfer, model: Path) -> dict[str, dict[str, list[str]]]:
    """The command line of every server, ports left as placeholders: {config: {side: argv}}."""
    commands: dict[str, dict[str, list[str]]] = {}
    for config in PD_CONFIGS:
        commands[config] = {}
        for side in ("prefill", "decode"):
            argv = server_config(options, model).base_argv(0)
            argv[argv.index("--port") + 1] = "<port>"
            commands[config][side] = [*argv, *side_args(config, side, options, transfer, "<bootstrap-port>")]
    return commands


def plan_pd(options: Options) -> tuple[str, dict[str, Any]]:
    details: dict[str, Any] = {
        "model": options.model,
        "prompts": list(PROMPTS[: options.prompts]),
        "max_new_tokens": options.max_new_tokens,
        "checks": "full and speculative greedy output_ids == plain's, per prompt; TTFT median",
        "log_dir": str(options.log_dir),
    }
    try:
        transfer = resolve_transfer(options.transfer, options.ib_device)
    except TransferUnavailable as exc:
        details["transfer"] = {"error": str(exc)}
        return f"would fail: {exc}", details
    model = Path(f"<{options.model} model folder>" if options.model in ("tiny", "smollm2") else options.model)
    details["transfer"] = asdict(transfer)
    details["commands"] = {
        config: {side: shlex.join(argv) for side, argv in sides.items()}
        for config, sides in server_commands(options, transfer, model).items()
    }
    return (
        f"{', '.join(PD_CONFIGS)} on {options.model}, {options.prompts} prompts x "
        f"{options.max_new_tokens} tokens, {transfer.backend} ({transfer.why})",
        details,
    )


def _model_path(choice: str) -> Path:
    from lynx.tools import models

    if choice == "tiny":
        return models.prepare_tiny()
    if choice == "smollm2":
        return models.prepare_smollm2()
    return Path(choice)


@dataclass(frozen=True)
class Answer:
    output_ids: list[int]
    ttft_s: float | None  # None: no token came
    lynx: list[dict[str, Any]] | None  # meta_info["lynx_transfer"]: present only with Lynx


def pd_stream(
    prefill_url: str, bootstrap_port: int, decode_url: str, prompt: str, max_new_tokens: int
) -> Answer:
    """One greedy request the way the router sends it: the same body, with bootstrap fields,
    to both servers; decode's answer streamed to time its first token."""
    first_token_at: list[float] = []

    def time_first_token(chunk: dict[str, Any]) -> None:
        if not first_token_at and chunk.get("output_ids"):
            first_token_at.append(time.perf_counter())

    body = pd_body(prompt, bootstrap_port, max_new_tokens)
    start = time.perf_counter()
    chunk = pd_generate(prefill_url, decode_url, body, REQUEST_TIMEOUT_S, on_chunk=time_first_token)
    ttft = first_token_at[0] - start if first_token_at else None
    return Answer(list(chunk.get("output_ids", [])), ttft, chunk.get("meta_info", {}).get("lynx_transfer"))


@dataclass(frozen=True)
class Comparison:
    equal: int
    total: int
    first_difference: list[int | None]  # per prompt: first differing token index, None if equal


def compare_outputs(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> Comparison:
    """Token-for-token comparison of each prompt's output with the reference's."""
    if len(reference) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(reference)} reference outputs")
    firsts: list[int | None] = []
    for ref, out in zip(reference, outputs, strict=True):
        if list(ref) == list(out):
            firsts.append(None)
            continue
        common = zip(ref, out, strict=False)  # lengths may differ: then the shorter one ends first
        firsts.append(next((i for i, (a, b) in enumerate(common) if a != b), min(len(ref), len(out))))
    return Comparison(sum(first is None for first in firsts), len(reference), firsts)


def _speculation_totals(answers: Sequence[Answer]) -> dict[str, int]:
    """Held and accepted tokens, and requests with a rejected held token, over the answers."""
    totals = {"held": 0, "accepted": 0, "rejections": 0}
    for answer in answers:
        # A stream's last chunk holds the report at its first token, then the final one.
        spec = (answer.lynx or [{}])[-1].get("speculation") or {}
        totals["held"] += int(spec.get("held", 0))
        totals["accepted"] += int(spec.get("accepted", 0))
        totals["rejections"] += int(bool(spec.get("rejected", False)))
    return totals


def run_config(
    config: str, model: Path, options: Options, transfer: Transfer, timeout_s: float
) -> list[Answer]:
    shared = server_config(options, model)
    bootstrap_port = free_port()
    servers = {
        side: SingleServer(
            shared,
            options.log_dir,
            name=f"{config}-{side}",
            args=side_args(config, side, options, transfer, bootstrap_port),
        )
        for side in ("prefill", "decode")
    }
    with running(servers, timeout_s):
        prefill, decode = servers["prefill"].url, servers["decode"].url
        pd_stream(prefill, bootstrap_port, decode, "warm up", 2)  # compiles, captures: not timed
        return [
            pd_stream(prefill, bootstrap_port, decode, prompt, options.max_new_tokens)
            for prompt in PROMPTS[: options.prompts]
        ]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _config_entry(config: str, got: Sequence[Answer], options: Options) -> tuple[dict[str, Any], list[str]]:
    """One configuration's figures, and what is wrong with its answers short of comparing
    them with plain PD's."""
    ttfts = [a.ttft_s for a in got if a.ttft_s is not None]
    entry: dict[str, Any] = {
        "flags": lynx_flags(config, options.residual_hold),
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_s": [a.ttft_s for a in got],
        "output_ids": [a.output_ids for a in got],
        "lynx_reports": sum(a.lynx is not None for a in got),
    }
    problems = []
    short = sum(len(a.output_ids) != options.max_new_tokens for a in got)
    if short:
        problems.append(f"{short} outputs not {options.max_new_tokens} tokens long")
    lynx_expected = 0 if config == "plain" else len(got)
    if entry["lynx_reports"] != lynx_expected:
        problems.append(f"{entry['lynx_reports']}/{len(got)} answers carry a Lynx transfer report")
    if config == "speculative":
        entry["speculation"] = _speculation_totals(got)
        if options.residual_hold > 0 and entry["speculation"]["held"] == 0:
            problems.append("no token was held: speculation was not exercised (raise --residual-hold)")
    return entry, problems


def evaluate_pd(
    answers: dict[str, list[Answer]], errors: dict[str, str], options: Options
) -> tuple[list[Item], dict[str, Any]]:
    """Each configuration's row and figures: its answers (or the error that stopped it),
    and Lynx's outputs compared token for token with plain PD's."""
    reference = [a.output_ids for a in answers.get("plain", [])]
    items, configs = [], {}
    for config in PD_CONFIGS:
        if config in errors:
            items.append(Item(config, "failed", errors[config]))
            configs[config] = {"error": errors[config], "flags": lynx_flags(config, options.residual_hold)}
            continue
        entry, problems = _config_entry(config, answers[config], options)
        text = (
            "no token came"
            if entry["ttft_median_s"] is None
            else f"TTFT median {entry['ttft_median_s'] * 1000:.0f} ms"
        )
        if "speculation" in entry:
            spec = entry["speculation"]
            text += f", {spec['held']} held / {spec['accepted']} accepted"
        if config != "plain" and not reference:
            problems.append("no plain PD outputs to compare with")
        elif config != "plain":
            comparison = compare_outputs(reference, entry["output_ids"])
            entry["equal_to_plain"] = comparison.equal
            entry["first_difference"] = comparison.first_difference
            text = f"{comparison.equal}/{comparison.total} equal to plain, " + text
            if comparison.equal != comparison.total:
                problems.append(f"{comparison.total - comparison.equal} outputs differ from plain PD's")
        configs[config] = entry
        items.append(Item(config, "failed" if problems else "ok", "; ".join([text, *problems])))
    return items, configs


def step_pd(ctx: Context) -> StepResult:
    options = ctx.options
    try:
        transfer = resolve_transfer(options.transfer, options.ib_device)
    except TransferUnavailable as exc:
        return StepResult("pd", "failed", str(exc))
    model = _model_path(options.model)
    answers: dict[str, list[Answer]] = {}
    errors: dict[str, str] = {}
    for config in PD_CONFIGS:
        if ctx.remaining_s() < MIN_CONFIG_S:
            errors[config] = "not started: time budget (--budget-s) spent"
            continue
        print(f"  pd {config}: starting prefill and decode", flush=True)
        try:
            answers[config] = run_config(config, model, options, transfer, ctx.remaining_s())
        except Exception as exc:  # this configuration failed; the next ones still run
            errors[config] = _first_line(exc)
            if isinstance(exc, ClusterError):
                errors[config] += f" (logs in {options.log_dir})"
    items, configs = evaluate_pd(answers, errors, options)
    status = _overall(items)
    reason = (
        "full and speculative outputs equal plain PD's token for token"
        if status == "ok"
        else "; ".join(f"{item.name}: {item.result}" for item in items if item.status == "failed")
    )
    return StepResult(
        "pd",
        status,
        reason,
        items=items,
        details={
            "model": str(model),
            "transfer": asdict(transfer),
            "prompts": options.prompts,
            "max_new_tokens": options.max_new_tokens,
            "log_dir": str(options.log_dir),
            "configs": configs,
        },
    )


# ---- running ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    name: str
    summary: str
    plan: Callable[[Options], tuple[str, dict[str, Any]]]  # (one line, details)
    run: Callable[[Context], StepResult]


REGISTRY: dict[str, Step] = {
    "codec": Step("codec", "Triton codec tests on the GPU", plan_codec, step_codec),
    "bytes": Step("bytes", "Triton bytes = CPU codec bytes (SHA-256)", plan_bytes, step_bytes),
    "throughput": Step("throughput", "codec GB/s vs peak memory bandwidth", plan_throughput, step_throughput),
    "pd": Step("pd", "plain PD vs Lynx full vs speculative on one GPU", plan_pd, step_pd),
}


def run_step(step: Step, ctx: Context) -> StepResult:
    """Run one step; an exception fails it, with its traceback in the details."""
    start = time.monotonic()
    try:
        result = step.run(ctx)
    except Exception as exc:
        result = StepResult(
            step.name, "failed", _first_line(exc), details={"traceback": traceback.format_exc()[-4000:]}
        )
    result.seconds = round(time.monotonic() - start, 2)
    return result


def exit_code(steps: Sequence[StepResult], options: Options, cuda: bool) -> int:
    if options.plan:
        return EXIT_OK
    if not cuda:
        return EXIT_NO_CUDA
    selected = [step for step in steps if step.name in options.steps]
    return EXIT_OK if selected and all(step.status == "ok" for step in selected) else EXIT_FAILED


def check(options: Options) -> dict[str, Any]:
    """Run (or, with --plan, describe) the selected steps; the JSON report."""
    started = time.monotonic()
    report: dict[str, Any] = {
        "tool": "lynx.tools.gpu_check",
        "schema": SCHEMA,
        "plan": options.plan,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {
            "hostname": platform.node(),
            "python": platform.python_version(),
            **{dist: _version(dist) for dist in DISTRIBUTIONS},
        },
        "options": options.to_json(),
    }
    results: list[StepResult] = []
    device: dict[str, Any] | None = None
    if options.plan:
        peak = peak_bandwidth(None, options.peak_gbps)
        report["device"] = {"name": None, "probed": False, "peak_gbps": peak.gbps, "peak_source": peak.source}
        for name in STEPS:
            if name in options.steps:
                line, details = REGISTRY[name].plan(options)
                item = Item(REGISTRY[name].summary, "planned", line)
                results.append(StepResult(name, "planned", "--plan: not run", items=[item], details=details))
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # before Triton is first imported
        device = cuda_device()
        no_cuda = None if device is not None else _no_cuda_reason()
        peak = peak_bandwidth(device["name"] if device else None, options.peak_gbps)
        report["device"] = {
            **(device or {"name": None}),
            "probed": True,
            "peak_gbps": peak.gbps,
            "peak_source": peak.source,
        }
        if no_cuda:
            report["no_cuda"] = no_cuda
        ctx = Context(options, peak, started + options.budget_s)
        for name in STEPS:
            if name not in options.steps:
                continue
            if device is None:
                results.append(StepResult(name, "skipped", "no CUDA device"))
            elif ctx.remaining_s() <= 0:
                results.append(StepResult(name, "skipped", "not started: time budget (--budget-s) spent"))
            else:
                print(f"== {name}: {REGISTRY[name].summary}", flush=True)
                results.append(run_step(REGISTRY[name], ctx))
    for name in STEPS:
        if name not in options.steps:
            results.append(StepResult(name, "skipped", "not selected (--steps)"))
    order = {name: i for i, name in enumerate(STEPS)}
    results.sort(key=lambda step: order[step.name])
    report["steps"] = [step.to_json() for step in results]
    code = exit_code(results, options, device is not None)
    report["exit_code"] = code
    report["ok"] = code == EXIT_OK
    report["seconds"] = round(time.monotonic() - started, 2)
    return report


def summary_table(report: dict[str, Any]) -> str:
    lines = ["| step | item | status | result |", "|---|---|---|---|"]
    for step in report["steps"]:
        if not step["items"]:
            lines.append(f"| {step['name']} | | {step['status']} | {step['reason']} |")
            continue
        for item in step["items"]:
            lines.append(f"| {step['name']} | {item['name']} | {item['status']} | {item['result']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    with terminate_on_sigterm():  # SIGTERM stops running servers on the way out
        report = check(options)
    device = report["device"]
    if not options.plan:
        name = device.get("name") or "no CUDA device"
        peak = (
            "unknown (--peak-gbps sets it)"
            if device["peak_gbps"] is None
            else f"{device['peak_gbps']:.0f} GB/s ({device['peak_source']})"
        )
        print(f"\ndevice: {name}; peak memory bandwidth: {peak}")
    print(summary_table(report))
    text = json.dumps(report, indent=1)
    if options.plan:
        print(text)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(text + "\n")
    print(f"wrote {options.out}")
    if report["exit_code"] == EXIT_NO_CUDA:
        print(f"gpu_check: no CUDA device: {report['no_cuda']}; every step skipped", file=sys.stderr)
    elif report["exit_code"] != EXIT_OK:
        bad = [
            f"{step['name']} ({step['status']}: {step['reason']})"
            for step in report["steps"]
            if step["name"] in options.steps and step["status"] != "ok"
        ]
        print(f"gpu_check: not every step passed: {'; '.join(bad)}", file=sys.stderr)
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
