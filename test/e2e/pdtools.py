"""Talking to real prefill and decode servers directly, as the router would: the e2e
modules' shared helpers."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from lynx.codec import KVLayout
from lynx.tools import cluster
from lynx.tools.cluster import ServerConfig, SingleServer, free_port, http_json, pd_body

# Small chunks make prefill send several chunks per request, as long prompts do.
COMMON = ["--chunked-prefill-size", "128", "--disable-radix-cache"]
# Upstream's strict idle memory check and KV page invariants, on every server that runs them.
CHECKS = {"SGLANG_CHECK_KV_PAGE_INVARIANTS": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}

# The tiny model's prompts: short ones, and one of several prefill chunks and Lynx segments.
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time " * 30,  # ~500 tokens: four prefill chunks of 128, two Lynx segments
    "1, 2, 3, 4, 5,",
]

# The shared speculative decode (conftest's ``PS``/``DS``): the Residual arrives late on
# purpose, and the Anchors are 2-bit on a tiny random model, so held tokens are often
# wrong: its users see both accepted and rejected speculation.
SPEC_HOLD_S = 1.5
SPEC_DEADLINE_S = 6.0
SPEC_CAP = 8
SPEC_EXACT = [  # the default residual: lossless
    "--lynx",
    "--lynx-mode",
    "speculative",
    "--lynx-anchor-bits",
    "2",
    "--lynx-max-speculative-tokens",
    str(SPEC_CAP),
    "--lynx-transfer-deadline",
    str(SPEC_DEADLINE_S),
    "--lynx-residual-hold",
    str(SPEC_HOLD_S),
]


def batch_variant(model: Path, env: dict[str, str]) -> ServerConfig:
    """FP32 arithmetic over a BF16 KV pool: the KV pool and the wire hold a BF16
    deployment's KV, and the CPU's FP32 matrix products (MKL) round a row differently with
    the batch's size, as GPU kernels and oneDNN's BF16 ones do (this host's BF16 products
    may not): only a verify pass that computes each held row as its decode step did can
    equal plain PD here."""
    return ServerConfig(
        model_path=model,
        max_total_tokens=4096,
        extra_args=[*COMMON, "--dtype", "float32", "--kv-cache-dtype", "bf16"],
        env=env,
    )


class Prefill(SingleServer):
    def __init__(self, config: ServerConfig, log_dir: Path, name: str, args: list[str]) -> None:
        self._lynx_args = list(args)
        super().__init__(config, log_dir, name=name)

    def _assign_ports(self) -> None:
        # The bootstrap port too: a retry after a port was taken must not reuse it.
        self.bootstrap_port = free_port()
        self._args = [
            *self._lynx_args,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-transfer-backend",
            "mooncake_tcp",
            "--disaggregation-bootstrap-port",
            str(self.bootstrap_port),
        ]
        super()._assign_ports()


def decode_server(config: ServerConfig, log_dir: Path, name: str, args: list[str]) -> SingleServer:
    return SingleServer(
        config,
        log_dir,
        name=name,
        args=[*args, "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake_tcp"],
    )


def pd_generate(
    prefill: Prefill,
    decode: SingleServer,
    prompt: str,
    max_new_tokens: int = 16,
    rid: str | None = None,
    sampling: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    timeout_s: float = 180.0,
) -> dict:
    """:func:`lynx.tools.cluster.pd_generate` of :func:`~lynx.tools.cluster.pd_body` between
    these two servers (``rid``: the request's id, for an abort)."""
    fields = {**(extra or {}), **({"rid": rid} if rid is not None else {})}
    body = pd_body(prompt, prefill.bootstrap_port, max_new_tokens, sampling=sampling, extra=fields)
    return cluster.pd_generate(prefill.url, decode.url, body, timeout_s)


def error_of(call: Callable[[], object]) -> str:
    """The error body of a request that must fail."""
    with pytest.raises(urllib.error.HTTPError) as failure:
        call()
    return failure.value.read().decode(errors="replace")


def bf16_batch_variance(model: Path, rows: int = 8) -> str | None:
    """Whether this host's BF16 matrix products round a row differently with the batch's
    size, at ``model``'s shapes: None where every product gives row 0 the same bits with 1
    to ``rows`` rows (this AMD EPYC's do), else which product does not (oneDNN's AMX
    kernels may not). Where they vary, a request's tokens depend on which requests shared
    its decode steps, in plain PD as in Lynx: two concurrent runs can differ at a near-tie."""
    config = json.loads((model / "config.json").read_text())
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    for n_in, n_out in ((hidden, hidden), (hidden, inner), (inner, hidden), (hidden, vocab)):
        weight = torch.randn(n_out, n_in, generator=generator).to(torch.bfloat16)
        x = torch.randn(rows, n_in, generator=generator).to(torch.bfloat16)
        alone = torch.nn.functional.linear(x[:1], weight)
        for m in range(2, rows + 1):
            if not torch.equal(torch.nn.functional.linear(x[:m], weight)[:1], alone):
                return f"a ({n_in} -> {n_out}) BF16 product rounds row 0 differently in a batch of {m}"
    return None


def speculation(answer: dict) -> dict:
    """The speculation report of a decode server's answer ({} if it did not speculate)."""
    (report,) = answer["meta_info"]["lynx_transfer"]
    return report.get("speculation") or {}


def state(server: SingleServer) -> dict:
    return http_json(server.url + "/server_info")["internal_states"][0]


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not {what} after {timeout_s:.0f} s")
        time.sleep(0.5)


def idle(server: SingleServer, kv_tokens: int | None = None) -> bool:
    """No Lynx request in flight, no buffer byte held, and (decode) the KV pool back to
    its idle size."""
    s = state(server)
    transfer = s["lynx_transfer"]
    quiet = transfer["rooms"] == 0 and transfer["buffer_used"] == 0 and transfer.get("quarantined", 0) == 0
    return quiet and (kv_tokens is None or s["lynx_kv_available_tokens"] == kv_tokens)


def kv_layout(model: Path) -> KVLayout:
    """The KV layout of ``model`` (its config.json) in a BF16 pool."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return KVLayout(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim, torch.bfloat16)


def push_control(endpoint: str, messages: list[list[bytes]]) -> None:
    """Send ``messages`` to a server's control socket at ``endpoint``, as any process that
    reaches it can (:func:`lynx.tools.cluster.lynx_control_endpoint`)."""
    import zmq  # a dependency of SGLang's, not of Lynx's core

    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 10_000)  # every message out before close returns
    socket.connect(endpoint)
    for message in messages:
        socket.send_multipart(message)
    socket.close()
    context.term()


def in_background(call: Callable[[], dict]) -> Future:
    """``call`` on a thread of its own; its future."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


def flush_cache(url: str) -> None:
    """Empty the radix cache of the server at ``url`` (waits until it is idle)."""
    # Upstream answers in text; 400 if the server did not go idle within the timeout.
    flush = urllib.request.Request(url + "/flush_cache?timeout=30", method="POST")
    with urllib.request.urlopen(flush, timeout=60) as response:
        assert response.status == 200


def signal_group(server: SingleServer, sig: signal.Signals) -> None:
    """Signal every process of a server (launcher, scheduler, detokenizer)."""
    proc = server.processes[0].process
    assert proc is not None
    os.killpg(proc.pid, sig)
