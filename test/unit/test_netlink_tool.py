"""``lynx.tools.netlink`` without root: the sides match scripts/netlink.sh, servers on a
side are configured for it, and the link comes down after the command it ran, also when
Ctrl-C interrupts (the script itself is replaced by a recorder; the real link runs in
``test/e2e/test_demo.py``)."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from lynx.tools import netlink
from lynx.tools.cluster import ServerConfig


def test_the_sides_are_the_namespaces_and_addresses_the_script_creates() -> None:
    script = netlink.SCRIPT.read_text()
    assigned = dict(re.findall(r"^(NS_A|NS_B|IP_A|IP_B)=(\S+)$", script, re.MULTILINE))
    assert (netlink.PREFILL.netns, netlink.PREFILL.address) == (assigned["NS_A"], assigned["IP_A"])
    assert (netlink.DECODE.netns, netlink.DECODE.address) == (assigned["NS_B"], assigned["IP_B"])


def test_a_server_on_a_side_runs_in_its_namespace_and_advertises_its_address(tmp_path: Path) -> None:
    config = ServerConfig(model_path=tmp_path, extra_args=["--x"], env={"KEEP": "1"})
    side = netlink.PREFILL.configure(config)
    assert side.base_argv(30000)[:4] == ["ip", "netns", "exec", "lynx-a"]
    assert side.host == "10.77.0.1" and "10.77.0.1" in side.base_argv(30000)
    assert side.env == {"KEEP": "1", "SGLANG_HOST_IP": "10.77.0.1"}
    assert (side.model_path, side.extra_args) == (config.model_path, config.extra_args)
    assert config.launcher == () and config.env == {"KEEP": "1"}  # the original is left alone


def test_it_says_why_the_link_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in (netlink.unusable() or "")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netlink.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    assert netlink.unusable() == "needs iproute2 (tc not found)"


class _Here(netlink.Side):
    """A side that is this namespace: runs the command as it is."""

    @property
    def launcher(self) -> tuple[str, ...]:
        return ()


@pytest.fixture
def script_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """What netlink.sh was asked to do, with the command's log at each call."""
    calls: list[str] = []
    log = tmp_path / "child.log"
    monkeypatch.setattr(netlink, "_netlink", lambda *args: calls.append(f"{' '.join(args)} [{_read(log)}]"))
    return calls


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


def test_the_link_is_up_while_the_command_runs_then_down(script_calls: list[str], tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    code = (
        "import os, sys; "
        f"open({str(log)!r}, 'w').write('ran in ' + os.environ[{netlink.INSIDE_ENV!r}]); sys.exit(3)"
    )
    assert netlink.run_on_side(_Here("ns-x", "10.0.0.9"), "20mbit", [sys.executable, "-c", code]) == 3
    assert script_calls == ["up 20mbit []", "down [ran in ns-x]"]


def test_ctrl_c_reaches_the_command_which_stops_before_the_link_goes_down(
    script_calls: list[str], tmp_path: Path
) -> None:
    log = tmp_path / "child.log"
    # The command stands for the demo: on SIGINT it "stops its servers" (slowly), then exits.
    code = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep(0.5)\n"
        f"    open({str(log)!r}, 'w').write('servers stopped'); sys.exit(130)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        f"open({str(log)!r}, 'w').write('started')\n"
        "time.sleep(60)\n"
    )

    def interrupt_once_started() -> None:
        deadline = time.monotonic() + 30
        while _read(log) != "started" and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C: to this process only

    handler = signal.getsignal(signal.SIGINT)
    interrupter = threading.Thread(target=interrupt_once_started)
    interrupter.start()
    try:
        code_seen = netlink.run_on_side(_Here("ns-x", "10.0.0.9"), "20mbit", [sys.executable, "-c", code])
    finally:
        interrupter.join()
    assert code_seen == 130
    assert script_calls == ["up 20mbit []", "down [servers stopped]"]
    assert signal.getsignal(signal.SIGINT) is handler  # restored


def test_a_signal_while_the_link_comes_up_takes_it_down_and_exits(
    monkeypatch: pytest.MonkeyPatch, script_calls: list[str]
) -> None:
    record = netlink._netlink

    def up_interrupted(*args: str) -> None:
        record(*args)
        if args[0] == "up":
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(netlink, "_netlink", up_interrupted)
    with pytest.raises(SystemExit) as exit_info:
        netlink.run_on_side(_Here("ns-x", "10.0.0.9"), "20mbit", [sys.executable, "-c", "pass"])
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert script_calls == ["up 20mbit []", "down []"]
