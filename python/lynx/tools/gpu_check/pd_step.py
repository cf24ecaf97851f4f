"""The ``pd`` step: Lynx's greedy outputs equal plain PD's on a GPU, token for token.

Runs:    per configuration, in order ``plain`` (no Lynx), Lynx ``full`` and Lynx
         ``speculative``, both with the exact residual: a prefill and a decode server started
         through SGLang's launcher (``lynx.tools.cluster``), sharing the GPU with
         ``--mem-fraction-static`` each, KV over Mooncake (``mooncake`` on RDMA where
         ``/sys/class/infiniband`` lists a device or ``--transfer rdma``, else
         ``mooncake_tcp``); one warm-up request, then the first ``--prompts`` of ``PROMPTS``,
         ``--max-new-tokens`` greedy tokens each, sent as the router sends them (decode's
         answer streamed to time its first token); then the servers are stopped. The
         speculative servers hold the Residual back ``--residual-hold`` seconds, so that
         tokens are held and verified. A configuration is not started with less than
         ``MIN_CONFIG_S`` of the budget left; a server start waits at most what is left.
Device:  the first CUDA device, for both servers (``SGLANG_USE_CPU_ENGINE=0``).
Reports: one row per configuration: how many outputs equal plain PD's, median TTFT, and for
         ``speculative`` the tokens held and accepted; details: per configuration the flags,
         TTFTs, output ids, Lynx transfer reports, first differing token per prompt; the
         model, transport, logs folder (``--log-dir``).
Fails:   when RDMA is asked for and there is no device; when a configuration does not start
         or a request fails (the error, with the logs folder; the next configurations still
         run); when an output of ``full`` or ``speculative`` differs from plain PD's, is not
         ``--max-new-tokens`` long, an answer lacks (plain: carries) a Lynx transfer report,
         plain PD gave no outputs to compare with, or ``speculative`` held no token while
         ``--residual-hold`` is above 0 (speculation was not exercised).

Provides:
    plan_pd(options) - the transport it would choose and every server's command line.
    step_pd(ctx) - run it.
    resolve_transfer(choice, ib_device, root) - Mooncake's transport and its flags.
    server_commands(options, transfer, model) - every server's command line, ports left as
        placeholders (also parsed by upstream's parser in test/plugin).
    evaluate_pd(answers, errors, options) - the rows and figures of the answers (pure).
    compare_outputs(reference, outputs) - token-for-token comparison (pure).
"""

from __future__ import annotations

import shlex
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lynx.tools.cluster import (
    ClusterError,
    ServerConfig,
    SingleServer,
    free_port,
    pd_body,
    pd_generate,
    running,
)
from lynx.tools.gpu_check.common import Context, Item, StepResult, error_line, overall_status
from lynx.tools.gpu_check.options import PROMPTS, RDMA_ROOT, Options

PD_CONFIGS = ("plain", "full", "speculative")
EXACT = ("--lynx-residual", "exact")
REQUEST_TIMEOUT_S = 120.0
MIN_CONFIG_S = 60.0  # budget left below which a PD configuration is not started


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
            errors[config] = error_line(exc)
            if isinstance(exc, ClusterError):
                errors[config] += f" (logs in {options.log_dir})"
    items, configs = evaluate_pd(answers, errors, options)
    status = overall_status(items)
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
