"""Start and stop real SGLang servers and the PD router as child processes.

Used by the demo, the end-to-end tests and the benchmarks, so all three run the same
commands a user would type.  Every server runs in its own process group, so stopping it
(also on Ctrl-C, SIGTERM or a failed start) takes its scheduler and detokenizer
subprocesses along and frees its ports.  Logs go to one file per process.

Nothing here imports SGLang: the servers are ``python -m sglang.launch_server`` and
``python -m sglang_router.launch_router`` subprocesses.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


class ClusterError(RuntimeError):
    """A server did not come up, or died; the message carries the end of its log."""


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORT_ATTEMPTS = 3


def _port_was_taken(log: Path) -> bool:
    try:
        return "address already in use" in log.read_text(errors="replace").lower()
    except OSError:
        return False


# Ports the servers choose for themselves at random: Mooncake's RPC and TCP transport
# listeners (``findAvailableTcpPort``, 15000-17000) and SGLang's NCCL/rendezvous port
# (``get_free_port_below_ephemeral``, 22000-29999). Handing one of them to a server invites a
# collision that only shows when the server binds.
_SERVERS_OWN_PORTS = (range(15000, 17001), range(22000, 30000))


def free_port() -> int:
    """A currently free TCP port below the kernel's ephemeral range and outside the ranges
    the servers pick their own ports from.

    Port 0 would hand out an ephemeral port, which the servers' own outgoing sockets
    (ZMQ, Mooncake, HTTP clients) may take before the server binds it.
    """
    low = max(_ephemeral_low(), 10500)
    for _ in range(1000):
        port = random.randrange(10000, low)
        if port in _handed_out or any(port in taken for taken in _SERVERS_OWN_PORTS):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise ClusterError(f"no free TCP port in 10000..{low}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def lynx_control_endpoint(log: Path) -> str:
    """Where the Lynx server that writes ``log`` hears its peer's control messages (offers
    on prefill, notices on decode): the ZMQ endpoint its "side ready" line names
    (:mod:`lynx_patches.runtime`), at which a drill aims forged messages."""
    text = log.read_text(errors="replace")
    match = re.search(r"Lynx (?:prefill|decode) side ready: .* on (tcp://\S+)", text)
    if match is None:
        raise ClusterError(f"no Lynx control endpoint in {log}")
    return match.group(1)


def http_json(url: str, payload: Mapping[str, Any] | None = None, timeout: float = 600.0) -> Any:
    """GET (payload None) or POST JSON; returns the decoded body or raises HTTPError."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"null")


def stream_json(url: str, payload: Mapping[str, Any], timeout: float = 600.0) -> Iterator[dict[str, Any]]:
    """POST ``payload`` with ``stream: true``; yields the JSON object of each server-sent
    event (upstream's ``data: {...}`` lines, ``data: [DONE]`` ends the stream). Closing the
    generator early closes the connection: that is how a client goes away mid-answer."""
    data = json.dumps({**payload, "stream": True}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            text = line.decode().strip()
            if text.startswith("data:") and text != "data: [DONE]":
                yield json.loads(text.removeprefix("data:"))


def pd_body(
    prompt: str,
    bootstrap_port: int,
    max_new_tokens: int = 16,
    *,
    bootstrap_host: str = HOST,
    sampling: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body a PD router sends both servers of one request: greedy,
    ``max_new_tokens`` tokens whatever EOS says (``sampling`` overrides any of it), the
    prefill's bootstrap address and a fresh room; ``extra``: more top-level fields (``rid``,
    ``return_logprob``, ...)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **(sampling or {})}
    return {
        "text": prompt,
        "sampling_params": params,
        "bootstrap_host": bootstrap_host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.getrandbits(62),
        **(extra or {}),
    }


def pd_generate(
    prefill_url: str,
    decode_url: str,
    body: Mapping[str, Any],
    timeout_s: float = 600.0,
    on_chunk: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """What a PD router does for one request, without one: ``body`` (:func:`pd_body`) to
    both servers at once; the answer is decode's (raises its HTTPError). With ``on_chunk``
    decode's answer is streamed, each chunk handed to it as it arrives, and the last chunk
    returned. Prefill's own answer carries nothing a client uses: it is waited for (so the
    request is over on both servers) and its errors are left to decode's answer."""
    with ThreadPoolExecutor(1) as pool:
        to_prefill = pool.submit(http_json, prefill_url + "/generate", body, timeout_s)
        try:
            if on_chunk is None:
                return http_json(decode_url + "/generate", body, timeout_s)
            chunk: dict[str, Any] = {}
            for chunk in stream_json(decode_url + "/generate", body, timeout_s):
                on_chunk(chunk)
            return chunk
        finally:
            with contextlib.suppress(OSError):  # urllib's errors, HTTPError included
                to_prefill.result()


@dataclass
class ManagedProcess:
    """One child process (in its own session) with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )

    def check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise ClusterError(
                f"{self.name} exited (code {code}); log {self.log_path}:\n{_tail(self.log_path)}"
            )
        # uvicorn logs a failed bind and then waits forever instead of exiting.
        tail = _tail(self.log_path, 20)
        if "error while attempting to bind" in tail:
            raise ClusterError(f"{self.name} could not bind its port; log {self.log_path}:\n{tail}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is None:
            return
        pgid = self.process.pid  # session leader: its pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_s)
        # Children may outlive the leader (SGLang's schedulers); sweep the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        self.process = None


def server_env(*, cpu: bool, threads: int | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    if threads is not None:
        # Two servers on a small host: without a cap each takes every core and both crawl.
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


@dataclass
class ServerConfig:
    """What every server of a cluster (or of one side of a PD cluster) shares."""

    model_path: Path
    cpu: bool = True
    max_total_tokens: int = 16384
    threads_per_server: int | None = 1
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = HOST
    # Idle schedulers otherwise spin a core each; on a small host four idle servers starve
    # everything else (a router took 90 s to start next to them).
    sleep_on_idle: bool = True
    # Prepended to the server command, e.g. ("ip", "netns", "exec", "lynx-a") to run it in
    # a network namespace behind a rate-limited link (lynx.tools.netlink).
    launcher: Sequence[str] = ()

    def base_argv(self, port: int) -> list[str]:
        argv = [
            *self.launcher,
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(port),
            "--max-total-tokens",
            str(self.max_total_tokens),
        ]
        if self.cpu:
            argv += ["--device", "cpu", "--attention-backend", "torch_native"]
        if self.sleep_on_idle:
            argv.append("--sleep-on-idle")
        return [*argv, *self.extra_args]


def _wait_until(
    ready: Callable[[], bool], processes: Sequence[ManagedProcess], timeout_s: float, what: str
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in processes:
            proc.check_alive()
        if ready():
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- end of {p.log_path}:\n{_tail(p.log_path, 15)}" for p in processes)
            raise ClusterError(f"{what} not ready after {timeout_s:.0f}s\n{tails}")
        time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class _Group:
    """Processes started together and stopped together, in reverse order."""

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    def launch(self, proc: ManagedProcess) -> ManagedProcess:
        self.processes.append(proc)
        proc.start()
        return proc

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    @property
    def log_paths(self) -> list[Path]:
        return [proc.log_path for proc in self.processes]

    def _assign_ports(self) -> None:
        """Choose fresh ports and rebuild every command that names them."""
        raise NotImplementedError

    def _start_once(self, timeout_s: float) -> None:
        """Launch every process and wait until the group serves; raises ClusterError."""
        raise NotImplementedError

    def _start(self, timeout_s: float) -> None:
        # A port free when handed out can be taken before the server binds it (by another
        # server's Mooncake engine or SGLang's own internal ports): retry on fresh ones.
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._start_once(timeout_s)
                return
            except ClusterError:
                taken = any(_port_was_taken(path) for path in self.log_paths)
                self.stop()
                if attempt + 1 == PORT_ATTEMPTS or not taken:
                    raise
                self._assign_ports()
            except BaseException:
                self.stop()
                raise

    def __enter__(self) -> _Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SingleServer(_Group):
    """A plain (non-disaggregated) SGLang server."""

    def __init__(
        self,
        config: ServerConfig,
        log_dir: Path,
        *,
        name: str = "single",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self._args = list(args)
        self._env = server_env(
            cpu=config.cpu, threads=config.threads_per_server, extra={**config.env, **(env or {})}
        )
        self._log = log_dir / f"{name}.log"
        self.name = name
        self._assign_ports()

    def _assign_ports(self) -> None:
        self.port = free_port()
        self.url = f"http://{self.config.host}:{self.port}"
        self._argv = [*self.config.base_argv(self.port), *self._args]

    def _start_once(self, timeout_s: float) -> None:
        proc = self.launch(ManagedProcess(self.name, self._argv, self._log, self._env))
        _wait_until(lambda: _healthy(self.url), [proc], timeout_s, self.name)

    def start(self, timeout_s: float = 600.0) -> SingleServer:
        self._start(timeout_s)
        return self

    def __enter__(self) -> SingleServer:
        return self.start()


class PDCluster(_Group):
    """``prefills`` prefill servers + ``decodes`` decode servers + ``sglang_router`` in PD
    mode, on loopback. The router pairs any prefill with any decode per request.

    ``prefill_config`` / ``decode_config`` replace ``config`` for that side's servers (each
    side in its own network namespace: :mod:`lynx.tools.netlink`); the router runs beside
    the decodes, with their host and launcher.

    ``prefill_url``, ``decode_url`` and ``bootstrap_port`` are the first servers'; the
    ``*_urls`` lists have all. ``processes`` holds the prefills, then the decodes, then the
    router; ``log_paths`` the same order."""

    def __init__(
        self,
        config: ServerConfig,
        log_dir: Path,
        *,
        transfer_backend: str = "mooncake_tcp",
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        router_args: Sequence[str] = (),
        prefills: int = 1,
        decodes: int = 1,
        prefill_config: ServerConfig | None = None,
        decode_config: ServerConfig | None = None,
    ) -> None:
        super().__init__()
        if prefills < 1 or decodes < 1:
            raise ValueError(
                f"a PD cluster needs a prefill and a decode server, got {prefills} and {decodes}"
            )
        self.config = config
        self.log_dir = log_dir
        self._prefill_config = prefill_config or config
        self._decode_config = decode_config or config
        self._counts = (prefills, decodes)
        self._transfer_backend = transfer_backend
        self._args = (list(prefill_args), list(decode_args), list(router_args))
        self._assign_ports()

    def _assign_ports(self) -> None:
        prefill_config, decode_config = self._prefill_config, self._decode_config
        prefills, decodes = self._counts
        prefill_args, decode_args, router_args = self._args
        prefill_ports = [free_port() for _ in range(prefills)]
        self.bootstrap_ports = [free_port() for _ in range(prefills)]
        decode_ports = [free_port() for _ in range(decodes)]
        self.router_port = free_port()
        self.prefill_urls = [f"http://{prefill_config.host}:{port}" for port in prefill_ports]
        self.decode_urls = [f"http://{decode_config.host}:{port}" for port in decode_ports]
        self.url = f"http://{decode_config.host}:{self.router_port}"
        common = ["--disaggregation-transfer-backend", self._transfer_backend]
        prefill_env, decode_env = (
            server_env(cpu=side.cpu, threads=side.threads_per_server, extra=side.env)
            for side in (prefill_config, decode_config)
        )
        # (log name, command, environment) of each server
        self._servers: list[tuple[str, list[str], dict[str, str]]] = [
            (
                _numbered("prefill", i),
                [
                    *prefill_config.base_argv(port),
                    *common,
                    "--disaggregation-mode",
                    "prefill",
                    "--disaggregation-bootstrap-port",
                    str(bootstrap),
                    *prefill_args,
                ],
                prefill_env,
            )
            for i, (port, bootstrap) in enumerate(zip(prefill_ports, self.bootstrap_ports, strict=True))
        ]
        self._servers += [
            (
                _numbered("decode", i),
                [*decode_config.base_argv(port), *common, "--disaggregation-mode", "decode", *decode_args],
                decode_env,
            )
            for i, port in enumerate(decode_ports)
        ]
        workers = [
            *(
                arg
                for url, bootstrap in zip(self.prefill_urls, self.bootstrap_ports, strict=True)
                for arg in ("--prefill", url, str(bootstrap))
            ),
            *(arg for url in self.decode_urls for arg in ("--decode", url)),
        ]
        self._router_argv = [
            *decode_config.launcher,
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            *workers,
            "--host",
            decode_config.host,
            "--port",
            str(self.router_port),
            "--prometheus-host",
            decode_config.host,
            "--prometheus-port",
            str(free_port()),
            *router_args,
        ]

    @property
    def prefill_url(self) -> str:
        return self.prefill_urls[0]

    @property
    def decode_url(self) -> str:
        return self.decode_urls[0]

    @property
    def bootstrap_port(self) -> int:
        return self.bootstrap_ports[0]

    @property
    def log_paths(self) -> list[Path]:
        return [self.log_dir / f"{name}.log" for name, _, _ in self._servers] + [self.log_dir / "router.log"]

    def _router_serves(self) -> bool:
        # The router answers 503 until it has registered both workers (~15 s after
        # their /health turns green), so only a real request tells it is ready.
        try:
            http_json(
                self.url + "/generate", {"text": "ping", "sampling_params": {"max_new_tokens": 1}}, timeout=60
            )
        except (urllib.error.URLError, OSError):
            return False
        return True

    def _start_once(self, timeout_s: float) -> None:
        servers = [
            self.launch(ManagedProcess(name, argv, self.log_dir / f"{name}.log", env))
            for name, argv, env in self._servers
        ]
        urls = [*self.prefill_urls, *self.decode_urls]
        _wait_until(
            lambda: all(_healthy(url) for url in urls), servers, timeout_s, "prefill and decode servers"
        )
        router = self.launch(
            ManagedProcess("router", self._router_argv, self.log_dir / "router.log", dict(os.environ))
        )
        # The router's Python start-up alone takes minutes on a loaded 2-core host.
        _wait_until(self._router_serves, [*servers, router], 600.0, "router")

    def start(self, timeout_s: float = 900.0) -> PDCluster:
        self._start(timeout_s)
        return self

    def __enter__(self) -> PDCluster:
        return self.start()


def _numbered(role: str, index: int) -> str:
    """``prefill``, ``prefill-1``, ...: the first server keeps the plain name."""
    return role if index == 0 else f"{role}-{index}"


def start_together(groups: Sequence[SingleServer | PDCluster], timeout_s: float | None = None) -> None:
    """Start several servers or clusters concurrently (each within ``timeout_s``, default
    its ``start``'s); if one fails, stop all and re-raise."""
    with ThreadPoolExecutor(len(groups)) as pool:
        futures = [
            pool.submit(group.start) if timeout_s is None else pool.submit(group.start, timeout_s)
            for group in groups
        ]
        errors = [future.exception() for future in futures]
    failed = [error for error in errors if error is not None]
    if failed:
        stop_together(groups)
        raise failed[0]


def stop_together(groups: Sequence[SingleServer | PDCluster]) -> None:
    """Stop several servers or clusters concurrently: each takes seconds to shut down
    gracefully (ten servers took a minute one after the other)."""
    with ThreadPoolExecutor(max(1, len(groups))) as pool:
        list(pool.map(lambda group: group.stop(), groups))


@contextlib.contextmanager
def running(group: dict[str, Any], timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
    """Start every server or cluster of ``group`` together, yield it, stop them all."""
    start_together(list(group.values()), timeout_s)
    try:
        yield group
    finally:
        stop_together(list(group.values()))


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so ``finally``/``with`` blocks stop the servers."""

    def _raise(_signum: int, _frame: object) -> None:
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
