"""The ``codec`` step: the Triton codec's unit tests, run on the GPU.

Runs:    ``python -m pytest -q -p no:cacheprovider test/unit/test_codec_triton.py
         test/unit/test_codec_lossless_cuda.py test/unit/test_sender_layers_cuda.py`` (the
         Anchor kernels, the device coder of the lossless Residual, the sender's
         layer-by-layer Anchors ordered by CUDA events) as a subprocess in ``--repo`` (this
         checkout by default)
         with TRITON_INTERPRET unset, so that the Triton kernels run on the GPU, not in
         Triton's interpreter, against the torch reference and the CPU codec; for at most
         300 s, and no longer than the budget left.
Device:  the first CUDA device (the test files run on it whenever torch sees one).
Reports: one row, the test files with pytest's summary line; details: the command, pytest's
         exit status, its summary and counts (passed, failed, skipped, ...), and the tail of
         its output when the step failed.
Fails:   when the test file is not under ``--repo``, pytest runs past its time, exits
         non-zero, or any collected test did not run and pass (a skipped test did not run
         on the GPU).

Provides:
    plan_codec(options) - the command and the folder it would run in, and whether the test
        file is there.
    step_codec(ctx) - run it.
    pytest_outcome(returncode, stdout) - the verdict on a ``pytest -q`` run (pure).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

from lynx.tools.gpu_check.common import Context, Item, StepResult
from lynx.tools.gpu_check.options import CODEC_TESTS, Options


def codec_command() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, CODEC_TESTS)]


def _missing(options: Options) -> list[str]:
    return [str(path) for path in CODEC_TESTS if not (options.repo / path).is_file()]


def plan_codec(options: Options) -> tuple[str, dict[str, Any]]:
    missing = _missing(options)
    found = not missing
    return (
        f"pytest {' '.join(map(str, CODEC_TESTS))} in {options.repo}, TRITON_INTERPRET unset"
        + ("" if found else f" ({', '.join(missing)} missing there: the step would fail)"),
        {
            "command": codec_command(),
            "cwd": str(options.repo),
            "env": "TRITON_INTERPRET unset: the kernels run on the GPU",
            "test_files_found": found,
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
    missing = _missing(options)
    if missing:
        return StepResult("codec", "failed", f"{', '.join(missing)} not found under {options.repo} (--repo)")
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
        items=[Item(" ".join(path.name for path in CODEC_TESTS), "ok" if ok else "failed", summary)],
        details=details,
    )
