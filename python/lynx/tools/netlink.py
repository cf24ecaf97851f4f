"""A rate-limited link between two network namespaces, for runs that must be bound by the
network rather than by a 2-core loopback: prefill on one side, decode on the other.

``scripts/netlink.sh`` creates and deletes the link (namespace ``lynx-a`` at 10.77.0.1,
``lynx-b`` at 10.77.0.2, a veth pair between them limited by tbf each way); this module
names its two sides, runs the script around a block (:func:`link`) and re-executes a tool
inside one side with the link up (:func:`run_on_side`), taking the link down however the
tool ends: normally, on an error, on Ctrl-C or on SIGTERM. A tool that runs prefill on one
side and decode on the other::

    if args.link and not netlink.inside():
        sys.exit(netlink.run_on_side(netlink.DECODE, args.link, [sys.executable, *sys.argv]))
    prefill_config = netlink.PREFILL.configure(config)   # in the re-executed process
    decode_config = netlink.DECODE.configure(config)

Needs root and iproute2 (:func:`unusable` says why not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lynx.tools.cluster import ServerConfig

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "netlink.sh"
# Set in a process re-executed by run_on_side, to the namespace it runs in.
INSIDE_ENV = "LYNX_NETNS"


@dataclass(frozen=True)
class Side:
    """One end of the link: a network namespace and its address on the veth pair."""

    netns: str
    address: str

    @property
    def launcher(self) -> tuple[str, ...]:
        """Prepended to a command to run it on this side."""
        return ("ip", "netns", "exec", self.netns)

    def configure(self, config: ServerConfig) -> ServerConfig:
        """``config`` for servers on this side: run in its namespace, serve on its address,
        and advertise that address for the KV transfer (``SGLANG_HOST_IP``), since the peer
        on the other side cannot reach this side's loopback."""
        return dataclasses.replace(
            config,
            host=self.address,
            launcher=self.launcher,
            env={**config.env, "SGLANG_HOST_IP": self.address},
        )


# As scripts/netlink.sh creates them (a unit test reads the script to keep them equal).
PREFILL = Side("lynx-a", "10.77.0.1")
DECODE = Side("lynx-b", "10.77.0.2")

_TEARDOWN_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def unusable() -> str | None:
    """Why the link cannot be built here, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces and tc qdiscs); run it with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({' and '.join(missing)} not found)"
    if not SCRIPT.is_file():
        return f"needs {SCRIPT} (run it from a checkout of the repo)"
    return None


def inside() -> bool:
    """Whether this process is the one :func:`run_on_side` re-executed."""
    return INSIDE_ENV in os.environ


def _netlink(*args: str) -> None:
    subprocess.run([str(SCRIPT), *args], check=True)


def set_rate(rate: str) -> None:
    """Change both directions' limit of the link that is up (``none``: no limit), e.g.
    between a benchmark's phases, without touching the servers on either side."""
    _netlink("rate", rate)


@contextlib.contextmanager
def link(rate: str) -> Iterator[None]:
    """The link up at ``rate`` (tc syntax: ``20mbit``) each way for the block, then down."""
    try:
        _netlink("up", rate)  # inside the try: an interrupted `up` leaves half a link
        yield
    finally:
        # A second Ctrl-C must not leave half a link behind either: the teardown, and the
        # script it runs (which inherits the mask), hold SIGINT and SIGTERM until it is done.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _TEARDOWN_SIGNALS)
        try:
            _netlink("down")
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def run_on_side(side: Side, rate: str, argv: Sequence[str]) -> int:
    """Bring the link up at ``rate``, run ``argv`` in ``side``'s namespace, take the link
    down once it exited; returns its exit code.

    The command runs in a session of its own, so a terminal's Ctrl-C reaches only this
    process, which passes SIGINT and SIGTERM on, once each, and waits: the command stops
    whatever it started in the namespaces before they are deleted (deleting a namespace
    leaves the processes in it running). A signal before the command started ends this
    process (exit code 128 + the signal) after taking the link down.
    """
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            raise SystemExit(128 + signum)
        child.send_signal(signum)  # a no-op once it has been waited for

    previous = {signum: signal.signal(signum, forward) for signum in _TEARDOWN_SIGNALS}
    try:
        with link(rate):
            child = subprocess.Popen(
                [*side.launcher, *argv], env={**os.environ, INSIDE_ENV: side.netns}, start_new_session=True
            )
            return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
