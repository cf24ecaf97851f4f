"""The main job cleans up after itself: on a failed start and on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def _processes_mentioning(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if str(os.getpid()) not in line.split()[0]]


def _unique_model(tiny_model: Path, tmp_path: Path) -> Path:
    # A private path to the model: every server's command line carries it, so pgrep can
    # find anything this test started and nothing else.
    link = tmp_path / "model-under-test"
    link.symlink_to(tiny_model)
    return link


def _interactive() -> None:
    # A shell starts background jobs (`scripts/test.sh &`) with SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler; the demo is run from a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _demo(model: Path, log_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "lynx.tools.demo", "--model", str(model), "--log-dir", str(log_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interactive,
    )


def test_failed_start_reports_the_log_and_leaves_nothing_running(tiny_model: Path, tmp_path: Path) -> None:
    model = _unique_model(tiny_model, tmp_path)
    # Valid for the demo, refused by the servers at start-up.
    log_dir = tmp_path / "logs"
    proc = _demo(model, log_dir, "--lynx-args", "--lynx --lynx-anchor-bits 9")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, out + err
    assert f"{log_dir}/{{prefill,decode,router}}.log" in out
    assert "--lynx-anchor-bits must be 2, 3 or 4" in err
    assert f"log {log_dir}/" in err
    assert _processes_mentioning(str(model)) == []


def test_ctrl_c_during_start_stops_every_server(tiny_model: Path, tmp_path: Path) -> None:
    model = _unique_model(tiny_model, tmp_path)
    log_dir = tmp_path / "logs"
    # Prefill holds every Anchor 30 s, so the start-up check's request (part of the start)
    # cannot finish before Ctrl-C arrives, however fast the servers come up.
    proc = _demo(model, log_dir, "--lynx-args", "--lynx --lynx-mode speculative --lynx-anchor-hold 30")
    deadline = time.monotonic() + 300
    while len(_processes_mentioning(str(model))) < 3:  # demo + prefill + decode at least
        assert time.monotonic() < deadline, "servers never started"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    time.sleep(5)  # let the servers spawn their scheduler subprocesses
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "servers stopped" in err
    assert _processes_mentioning(str(model)) == []
