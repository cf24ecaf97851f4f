"""Running a probe script (this folder's ``probe_*.py``) in a fresh interpreter, as the
SGLang launcher would, and reading the JSON it prints: hooks never leak into pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
CPU_ENV = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
CPU_ENV.pop("SGLANG_HOST_IP", None)


def run_probe(script: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        capture_output=True,
        text=True,
        env=CPU_ENV,
        timeout=600,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("PROBE-RESULT "))
