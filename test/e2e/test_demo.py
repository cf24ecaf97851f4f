"""The main job cleans up after itself: on a failed start and on Ctrl-C; over a slow link
(``--link``) it shows what Lynx held and accepted and compares TTFT with plain PD, and
leaves no namespace behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lynx.tools import netlink

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


def test_the_default_path_serves_an_answer_and_stops_everything(tiny_model: Path, tmp_path: Path) -> None:
    """``scripts/demo.sh`` with no argument, but on the tiny model (CI fetches no other):
    the default Lynx flags on both servers, the default question, one chat completion
    through the router, its TTFT and Lynx's bytes, and every server stopped after."""
    model = _unique_model(tiny_model, tmp_path)
    proc = _demo(model, tmp_path / "logs")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    answer = re.search(r"^answer: (.+)$", out, re.MULTILINE)
    assert answer is not None and answer.group(1).strip(), out
    assert re.search(r"^TTFT: \d+ ms   completion tokens: [1-9]\d* ", out, re.MULTILINE), out
    anchor, residual = map(int, re.findall(r"Anchor (\d+) KiB, Residual (\d+) KiB", out)[0])
    assert anchor > 0 and residual > 0, out  # Lynx carried the KV, both parts
    assert out.rstrip().endswith("servers stopped")
    assert _processes_mentioning(str(model)) == []


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


def _link_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return sorted(names & {netlink.PREFILL.netns, netlink.DECODE.netns})


@pytest.fixture
def no_link() -> None:
    """Skip where --link cannot run, or where another run's link is up (``up`` would delete it)."""
    reason = netlink.unusable()
    if reason is not None:
        pytest.skip(f"--link {reason}")
    if _link_namespaces():
        pytest.skip(f"namespaces {_link_namespaces()} exist: another run's link, left alone")


@pytest.mark.usefixtures("no_link")
def test_over_a_slow_link_tokens_are_held_and_accepted_and_ttft_compared(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = _unique_model(tiny_model, tmp_path)
    # Strict verification of a random model's near-tie logits often rejects the first held
    # token, whatever the Residual: the tolerance makes acceptance this test's to see (the
    # exactness of strict verification is test_lynx_speculative.py's).
    lynx = "--lynx --lynx-mode speculative --lynx-verify-tolerance 1"
    proc = _demo(model, tmp_path / "logs", "--link", "20mbit", "--lynx-args", lynx)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    # 1500 prompt tokens (the default): the Residual lands after decoding started.
    held, accepted = map(int, re.findall(r"tokens held on the Anchor: (\d+), accepted: (\d+)", out)[0])
    assert held > 0 and accepted > 0, out
    anchor_ms, residual_ms = map(int, re.findall(r"Anchor at (\d+) ms, Residual at (\d+) ms", out)[0])
    assert 0 < anchor_ms < residual_ms, out
    assert re.search(r"TTFT over the 20mbit link: Lynx [\d.]+ s, plain PD [\d.]+ s \(Lynx / plain PD = ", out)
    assert len(re.findall(r"^TTFT: \d+ ms", out, re.MULTILINE)) == 2, out
    assert "Lynx: off on decode (plain upstream PD)" in out
    assert _link_namespaces() == []
    assert _processes_mentioning(str(model)) == []


@pytest.mark.usefixtures("no_link")
def test_ctrl_c_during_a_link_start_stops_every_server_and_deletes_the_link(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = _unique_model(tiny_model, tmp_path)
    proc = _demo(model, tmp_path / "logs", "--link", "20mbit")
    deadline = time.monotonic() + 300
    # the demo, its copy on decode's side of the link, prefill and decode at least
    while len(_processes_mentioning(str(model))) < 4:
        assert time.monotonic() < deadline, "servers never started"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    assert _link_namespaces() == ["lynx-a", "lynx-b"]
    time.sleep(5)  # let the servers spawn their scheduler subprocesses
    proc.send_signal(signal.SIGINT)  # to the demo only: it passes it on
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "servers stopped" in err and "link down" in out
    assert _link_namespaces() == []
    assert _processes_mentioning(str(model)) == []
