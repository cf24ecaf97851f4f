"""``lynx.tools.cluster.PDCluster``'s command lines for several prefill and decode servers,
and for each side in its own network namespace (the servers themselves run in
``test/e2e/test_pd_cluster.py`` and ``test/e2e/test_demo.py``), its retry on ports taken
before a server bound them, its streamed-answer reader, and one request sent to a prefill and
a decode server as the router sends it."""

from __future__ import annotations

import contextlib
import http.server
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from lynx.tools import netlink
from lynx.tools.cluster import (
    PORT_ATTEMPTS,
    ClusterError,
    PDCluster,
    ServerConfig,
    free_port,
    pd_body,
    pd_generate,
    stream_json,
)


def test_the_router_gets_every_prefill_with_its_bootstrap_port_and_every_decode(tmp_path: Path) -> None:
    cluster = PDCluster(ServerConfig(model_path=tmp_path), tmp_path, prefills=2, decodes=3)
    argv = cluster._router_argv
    prefills = [argv[i + 1 : i + 3] for i, arg in enumerate(argv) if arg == "--prefill"]
    decodes = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--decode"]
    bootstraps = [str(port) for port in cluster.bootstrap_ports]
    assert prefills == [[url, port] for url, port in zip(cluster.prefill_urls, bootstraps, strict=True)]
    assert decodes == cluster.decode_urls and len(set(decodes)) == 3
    assert (cluster.prefill_url, cluster.decode_url) == (cluster.prefill_urls[0], cluster.decode_urls[0])
    names = [path.name for path in cluster.log_paths]
    assert names == [
        "prefill.log",
        "prefill-1.log",
        "decode.log",
        "decode-1.log",
        "decode-2.log",
        "router.log",
    ]
    for (name, server_argv, _env), bootstrap in zip(cluster._servers, cluster.bootstrap_ports, strict=False):
        assert name.startswith("prefill")
        assert server_argv[server_argv.index("--disaggregation-bootstrap-port") + 1] == str(bootstrap)


def test_a_cluster_needs_both_sides(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs a prefill and a decode server, got 1 and 0"):
        PDCluster(ServerConfig(model_path=tmp_path), tmp_path, decodes=0)


def test_each_side_can_run_in_its_own_namespace_with_the_router_beside_decode(tmp_path: Path) -> None:
    config = ServerConfig(model_path=tmp_path)
    cluster = PDCluster(
        config,
        tmp_path,
        prefill_config=netlink.PREFILL.configure(config),
        decode_config=netlink.DECODE.configure(config),
    )
    (prefill, prefill_argv, prefill_env), (decode, decode_argv, decode_env) = cluster._servers
    assert (prefill, decode) == ("prefill", "decode")
    assert prefill_argv[:4] == ["ip", "netns", "exec", "lynx-a"]
    assert prefill_argv[prefill_argv.index("--host") + 1] == "10.77.0.1"
    assert (prefill_env["SGLANG_HOST_IP"], decode_env["SGLANG_HOST_IP"]) == ("10.77.0.1", "10.77.0.2")
    assert decode_argv[:4] == cluster._router_argv[:4] == ["ip", "netns", "exec", "lynx-b"]
    assert cluster.prefill_url.startswith("http://10.77.0.1:")
    assert cluster.decode_url.startswith("http://10.77.0.2:") and cluster.url.startswith("http://10.77.0.2:")
    router = cluster._router_argv
    assert router[router.index("--prefill") + 1] == cluster.prefill_url
    assert router[router.index("--host") + 1] == "10.77.0.2"


def test_without_side_configs_every_server_gets_the_shared_one(tmp_path: Path) -> None:
    cluster = PDCluster(ServerConfig(model_path=tmp_path, env={"X": "1"}), tmp_path)
    assert all(argv[0] == sys.executable and env["X"] == "1" for _, argv, env in cluster._servers)
    assert cluster.url.startswith("http://127.0.0.1:") and cluster._router_argv[0] == sys.executable


class _EventStream(http.server.BaseHTTPRequestHandler):
    """Answers like upstream's streamed /generate: ``data: {json}`` events, blank lines
    between them, ``data: [DONE]`` last; records the body and whether the client left."""

    bodies: ClassVar[list[dict]] = []
    client_left = threading.Event()

    def do_POST(self) -> None:
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [{"output_ids": list(range(n))} for n in range(1, 200)]
        try:
            for event in events:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.01)
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            self.client_left.set()

    def log_message(self, *args: object) -> None:
        pass


def test_handed_out_ports_avoid_the_ranges_mooncake_and_sglang_pick_their_own_from() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    assert not [port for port in ports if 15000 <= port <= 17000 or 22000 <= port <= 29999]


class _ClusterWhoseServersFail(PDCluster):
    """Its servers fail to start ``failures`` times, writing ``log_line`` to decode's log;
    records the commands each attempt would have run."""

    def __init__(self, log_dir: Path, failures: int, log_line: str) -> None:
        super().__init__(ServerConfig(model_path=log_dir), log_dir, prefills=2)
        self.failures, self.log_line = failures, log_line
        self.attempts: list[list[list[str]]] = []

    def _start_once(self, timeout_s: float) -> None:
        self.attempts.append([argv for _, argv, _ in self._servers] + [self._router_argv])
        if len(self.attempts) <= self.failures:
            (self.log_dir / "decode.log").write_text(self.log_line)
            raise ClusterError("decode did not start")


TAKEN = (
    "ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 16042): address already in use"
)


def test_a_cluster_whose_port_was_taken_restarts_on_fresh_ports(tmp_path: Path) -> None:
    cluster = _ClusterWhoseServersFail(tmp_path, failures=1, log_line=TAKEN)
    assert cluster.start() is cluster
    first, second = cluster.attempts
    ports = [
        cluster.router_port,
        *cluster.bootstrap_ports,
        *(int(u.rsplit(":", 1)[1]) for u in cluster.prefill_urls),
    ]
    assert not any(str(port) in argv for port in ports for argv in first)
    assert all(str(port) in " ".join(" ".join(argv) for argv in second) for port in ports)


def test_a_cluster_gives_up_after_its_attempts_or_on_any_other_failure(tmp_path: Path) -> None:
    always_taken = _ClusterWhoseServersFail(tmp_path, failures=PORT_ATTEMPTS, log_line=TAKEN)
    with pytest.raises(ClusterError):
        always_taken.start()
    assert len(always_taken.attempts) == PORT_ATTEMPTS
    crashed = _ClusterWhoseServersFail(tmp_path, failures=1, log_line="RuntimeError: out of memory")
    with pytest.raises(ClusterError):
        crashed.start()
    assert len(crashed.attempts) == 1


@pytest.fixture
def event_server() -> Iterator[str]:
    _EventStream.bodies.clear()
    _EventStream.client_left.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _EventStream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/generate"
    server.shutdown()
    thread.join()


def test_stream_json_yields_each_event_and_asks_for_a_stream(event_server: str) -> None:
    chunks = list(stream_json(event_server, {"text": "hi"}, timeout=30))
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 200))
    assert _EventStream.bodies == [{"text": "hi", "stream": True}]


def test_closing_stream_json_early_closes_the_connection(event_server: str) -> None:
    with contextlib.closing(stream_json(event_server, {"text": "hi"}, timeout=30)) as chunks:
        assert next(chunks) == {"output_ids": [0]}
    assert _EventStream.client_left.wait(timeout=30), "the server kept streaming to a client that left"


def _json_server(status: int, answer: dict) -> tuple[http.server.ThreadingHTTPServer, list[dict]]:
    """A server answering every POST with ``status`` and ``answer``; the bodies it got."""
    bodies: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, bodies


@pytest.fixture
def failing_prefill() -> Iterator[tuple[str, list[dict]]]:
    server, bodies = _json_server(500, {"error": "prefill's own answer"})
    yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    server.shutdown()


def test_pd_body_is_what_a_router_sends_both_servers() -> None:
    body = pd_body("hi", 9000, 8, sampling={"temperature": 0.7}, extra={"rid": "r1"})
    assert body["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.7, "ignore_eos": True}
    assert (body["bootstrap_host"], body["bootstrap_port"], body["rid"]) == ("127.0.0.1", 9000, "r1")
    assert (
        0 <= body["bootstrap_room"] < 2**62
        and body["bootstrap_room"] != pd_body("hi", 9000)["bootstrap_room"]
    )


def test_pd_generate_answers_with_decodes_answer_whatever_prefill_says(failing_prefill: tuple) -> None:
    prefill_url, prefill_bodies = failing_prefill
    decode, decode_bodies = _json_server(200, {"output_ids": [1, 2]})
    decode_url = f"http://127.0.0.1:{decode.server_address[1]}"
    body = pd_body("hi", 9000)
    try:
        assert pd_generate(prefill_url, decode_url, body, 30) == {"output_ids": [1, 2]}
    finally:
        decode.shutdown()
    assert prefill_bodies == decode_bodies == [body]


def test_pd_generate_streams_decodes_answer_chunk_by_chunk(failing_prefill: tuple, event_server: str) -> None:
    prefill_url, prefill_bodies = failing_prefill
    body = pd_body("hi", 9000)
    chunks: list[dict] = []
    last = pd_generate(prefill_url, event_server.removesuffix("/generate"), body, 30, on_chunk=chunks.append)
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 200)) and last == chunks[-1]
    assert _EventStream.bodies == [{**body, "stream": True}] and prefill_bodies == [body]
