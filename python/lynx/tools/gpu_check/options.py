"""The check's command line: the flags, checked, as one frozen ``Options``.

Provides:
    parse_args(argv) - the ``Options`` of a command line, or exit 2 with argparse's usage
        and a message naming the flag at fault (an unknown step, a number out of range,
        ``--ib-device`` with ``--transfer tcp``, a ``--model`` folder without config.json
        when the pd step is selected, ...). Reads no device and starts nothing.
    build_parser() - the argparse parser behind it (``--help``).
    Options.to_json() - the options as the report's ``options`` entry (paths as strings).

``--steps`` is canonicalised: each step once, in ``STEPS`` order, whatever the order given.
``--ib-device`` implies ``--transfer rdma``. The constants the flags are bounded by or name
(``PROMPTS``, ``CODEC_TESTS``, ``RDMA_ROOT``) live here, and the steps read them from here.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lynx.tools.gpu_check.device import PEAK_GBPS

DESCRIPTION = "The GPU check: a prepared run on one CUDA host, a few minutes long, not part of CI."
STEPS = ("codec", "bytes", "throughput", "pd")
DEFAULT_OUT = Path("benchmark/results/gpu_check.json")
CODEC_TESTS = (
    Path("test/unit/test_codec_triton.py"),
    Path("test/unit/test_codec_lossless_cuda.py"),
    Path("test/unit/test_sender_layers_cuda.py"),
)
RDMA_ROOT = Path("/sys/class/infiniband")
PROMPTS = (  # the pd step's greedy prompts; --prompts takes the first ones
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time " * 60,  # ~1000 tokens of the tiny model: several 256-token segments
    "1, 2, 3, 4, 5,",
    "In a hole in the ground there lived",
    "Explain in one sentence why the sky is blue:",
)


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
    checkout = Path(__file__).resolve().parents[4]
    return checkout if (checkout / CODEC_TESTS[0]).is_file() else Path.cwd()


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
        description=DESCRIPTION,
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
        "--repo", type=Path, default=None, help="the checkout holding the codec tests (default: this one)"
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
