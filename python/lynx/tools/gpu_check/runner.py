"""Runs the selected steps in order and reports: the summary table, the JSON, the exit status.

Provides:
    check(options) - the JSON report. Under ``--plan``: each selected step's plan, status
        "planned", no CUDA device touched (the device entry is not probed). Otherwise:
        TRITON_INTERPRET is unset, the device probed, and each selected step run in
        ``STEPS`` order while ``--budget-s`` lasts (a step is not started after it: it is
        "skipped"); without a CUDA device every selected step is "skipped". An exception
        fails its step alone. Steps not selected are "skipped" ("not selected (--steps)").
        The report: tool, schema, plan, start time, host (Python and the versions of
        ``DISTRIBUTIONS``), options, device, steps (name, status, reason, seconds, items,
        details), exit code, ok, seconds.
    main(argv) - ``python -m lynx.tools.gpu_check``: parse the flags, run ``check`` (SIGTERM
        stops running servers on the way out), print the device line and the summary table
        (and the JSON under ``--plan``), write ``--out``, name what did not pass on stderr;
        return the exit status.
    exit_code(steps, options, cuda) - 0 every selected step ok (or ``--plan``); 1 a selected
        step failed or was not run; 3 no CUDA device. 2, a usage error, comes from argparse.
    summary_table(report) - the Markdown table: one row per item, or per step without items.
    REGISTRY - each step's name, its title in the table, its plan and its run (``common``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from lynx.tools.cluster import terminate_on_sigterm
from lynx.tools.gpu_check.bytes_step import plan_bytes, step_bytes
from lynx.tools.gpu_check.codec_step import plan_codec, step_codec
from lynx.tools.gpu_check.common import Context, Item, StepResult, error_line
from lynx.tools.gpu_check.device import cuda_device, no_cuda_reason, peak_bandwidth
from lynx.tools.gpu_check.options import STEPS, Options, parse_args
from lynx.tools.gpu_check.pd_step import plan_pd, step_pd
from lynx.tools.gpu_check.throughput_step import plan_throughput, step_throughput

DISTRIBUTIONS = (
    "torch",
    "triton",
    "sglang",
    "sglang-router",
    "mooncake-transfer-engine",  # the CUDA/RDMA build (extra cuda)
    "mooncake-transfer-engine-non-cuda",  # the TCP build (extra cpu): should be absent here
)
SCHEMA = 1
EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA = 0, 1, 3  # 2, a usage error, is argparse's own


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


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
            step.name, "failed", error_line(exc), details={"traceback": traceback.format_exc()[-4000:]}
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
        no_cuda = None if device is not None else no_cuda_reason()
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
