"""What every step is given and what it returns: the shared vocabulary of the check.

A step is two functions, registered in ``runner.REGISTRY``:
    plan(options) -> (line, details) - what the step would run, as one line for the
        summary table and a dict for the JSON report. Runs under ``--plan``: it must touch
        no CUDA device and start nothing.
    run(ctx) -> StepResult - run the step on the GPU within ``ctx.remaining_s()``. Its
        status is "ok" or "failed" with a one-line reason, per-row ``items`` for the table
        and JSON-able ``details``. An exception fails the step (the runner records its
        traceback); the steps after it still run.

Provides ``Item`` (one table row), ``StepResult``, ``Context`` (the options, the device's
peak bandwidth, the deadline of ``--budget-s``), ``overall_status`` (failed if any row
failed) and ``error_line`` (an exception as one line).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lynx.tools.gpu_check.device import Peak
from lynx.tools.gpu_check.options import Options

Status = Literal["ok", "failed", "skipped", "planned"]


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


def overall_status(items: Sequence[Item]) -> Status:
    return "failed" if any(item.status == "failed" for item in items) else "ok"


@dataclass
class Context:
    options: Options
    peak: Peak
    deadline: float  # time.monotonic()

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


def error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
