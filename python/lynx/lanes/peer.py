"""A receiving peer in its own process: one Mooncake engine, one registered buffer.

The integration tests and benchmark/lanes.py write into it; it reports where its buffer is
and checksums spans of it on request. Run it alone to probe a link:

    python -m lynx.lanes.peer --host 127.0.0.1 --size 67108864

Line protocol (JSON, one object per line). The peer first prints
`{"session": "host:port", "base": <buffer address>, "size": <bytes>}` on stdout, then
answers each command read from stdin:
`{"op": "digest", "spans": [[offset, length], ...]}` -> `{"digests": ["<hex>", ...]}`
(blake2b-128 of each span of its buffer), `{"op": "exit"}` -> exits 0 (so does EOF).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from lynx.lanes.mooncake import MooncakeBackend


def span_digest(view: memoryview, offset: int, length: int) -> str:
    return hashlib.blake2b(view[offset : offset + length], digest_size=16).hexdigest()


def buffer_address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def serve(host: str, size: int, commands: IO[str], replies: IO[str]) -> None:
    backend = MooncakeBackend(host)
    buffer = mmap.mmap(-1, size)
    base = buffer_address(buffer)
    backend.register_memory(base, size)
    view = memoryview(buffer)

    def reply(obj: object) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"session": backend.session_id, "base": base, "size": size})
    for line in commands:
        command = json.loads(line)
        if command["op"] == "digest":
            reply({"digests": [span_digest(view, off, n) for off, n in command["spans"]]})
        elif command["op"] == "exit":
            break
        else:
            reply({"error": f"unknown op {command['op']!r}"})


def _thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of `pid` (``T``: stopped by a signal)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            # "tid (comm) S ...": the command may hold spaces and parentheses
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # the thread ended
    return states


class PeerProcess:
    """Starts `python -m lynx.lanes.peer` (optionally under a prefix such as
    `ip netns exec NS`) and speaks its line protocol."""

    def __init__(self, host: str, size: int, prefix: Sequence[str] = ()) -> None:
        argv = [*prefix, sys.executable, "-m", "lynx.lanes.peer", "--host", host]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self._proc = subprocess.Popen(
            [*argv, "--size", str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # the engine's glog chatter
            text=True,
            env=env,
        )
        hello = self._read()
        self.session: str = hello["session"]
        self.base: int = hello["base"]
        self.size: int = hello["size"]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self._proc.wait()} before answering")
        return json.loads(line)

    def _send(self, obj: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(obj) + "\n")
        self._proc.stdin.flush()

    def digests(self, spans: Sequence[tuple[int, int]]) -> list[str]:
        """blake2b-128 of each (offset, length) span of the peer's buffer."""
        self._send({"op": "digest", "spans": [list(s) for s in spans]})
        return self._read()["digests"]

    def freeze(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP the peer and return once every thread of it has stopped. The signal lands
        asynchronously: a peer still running a few milliseconds later answers a probe sent
        right after (so a peer "frozen before its first write" would pass its probe, and
        the first write would then block in the engine's handshake)."""
        os.kill(self._proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all(state == "T" for state in _thread_states(self._proc.pid)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer {self.session} not stopped {timeout_s:g} s after SIGSTOP")
            time.sleep(0.001)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)
            try:
                self._send({"op": "exit"})
                self._proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    parser.add_argument("--size", type=int, required=True, help="bytes to register")
    args = parser.parse_args()
    serve(args.host, args.size, sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
