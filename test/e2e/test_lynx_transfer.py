"""Lynx's KV transfer between real prefill and decode servers: exactness, bytes, pairing,
faults.

Requests go straight to a prefill and a decode server with the bootstrap fields the
router would add, so each test picks the pair (and the failure) it needs. Servers, all
on the tiny model and started once for the module:

* ``P`` (prefill), ``D1``/``D2`` (decode): ``--lynx`` full mode with the exact residual,
  Residual writes held ``HOLD_S`` seconds (a slow link on demand: the window in which
  the fault tests strike); ``D1`` with ``--enable-metrics``;
* ``P0``/``D0``: plain PD without ``--lynx`` (the BF16 reference, and the peers without
  Lynx for the pairing tests);
* ``PA``/``DA``: ``--lynx-mode anchor-only`` with 2-bit Anchors.

The router path (OpenAI API, streaming) with ``--lynx`` is in test_pd_cluster.py.
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from pdtools import Prefill, decode_server, error_of, idle, pd_generate, signal_group, state, wait_for

from lynx.codec import CodecConfig, KVLayout
from lynx.mode import Mode
from lynx.tools.cluster import ServerConfig, SingleServer, http_json, running
from lynx.transfer import RequestLayout

pytestmark = pytest.mark.e2e

HOLD_S = 2.0
# Below upstream's dead-prefill detection (heartbeat every 5 s, two misses), so a stalled
# prefill is caught by Lynx's own deadline.
DEADLINE_S = 6.0
COMMON = ["--chunked-prefill-size", "128", "--disable-radix-cache"]
EXACT = ["--lynx", "--lynx-residual", "exact", "--lynx-transfer-deadline", str(DEADLINE_S)]
HELD = [*EXACT, "--lynx-residual-hold", str(HOLD_S)]
ANCHOR_ONLY = ["--lynx", "--lynx-mode", "anchor-only", "--lynx-anchor-bits", "2"]
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time " * 30,  # ~500 tokens: four prefill chunks, two Lynx segments
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def config(tiny_model: Path) -> ServerConfig:
    # A decode whose prefill died holds the failed requests' pages for a drain ACK that never
    # comes, until upstream's release timeout (30 s by default): shorter here.
    return ServerConfig(
        model_path=tiny_model,
        max_total_tokens=4096,
        extra_args=COMMON,
        env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "10"},
    )


@pytest.fixture(scope="module")
def servers(config: ServerConfig, log_dir: Path) -> Iterator[dict[str, Any]]:
    group: dict[str, Any] = {
        "P": Prefill(config, log_dir, "P", HELD),
        "D1": decode_server(config, log_dir, "D1", [*HELD, "--enable-metrics"]),
        "D2": decode_server(config, log_dir, "D2", HELD),
        "P0": Prefill(config, log_dir, "P0", []),
        "D0": decode_server(config, log_dir, "D0", []),
        "PA": Prefill(config, log_dir, "PA", ANCHOR_ONLY),
        "DA": decode_server(config, log_dir, "DA", ANCHOR_ONLY),
    }
    with running(group):
        yield group


@pytest.fixture(scope="module")
def idle_kv(servers: dict) -> dict[str, int]:
    """Free KV tokens of each Lynx decode server before any test request."""
    return {name: state(servers[name])["lynx_kv_available_tokens"] for name in ("D1", "D2", "DA")}


def kv_layout(model: Path) -> KVLayout:
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return KVLayout(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim, torch.bfloat16)


# ---- exactness and bytes ---------------------------------------------------------------


def test_full_mode_with_exact_residual_equals_plain_bf16_pd(servers: dict, idle_kv: dict) -> None:
    for prompt in PROMPTS:
        lynx = pd_generate(servers["P"], servers["D1"], prompt)
        plain = pd_generate(servers["P0"], servers["D0"], prompt)
        assert lynx["output_ids"] == plain["output_ids"], prompt[:40]
        assert lynx["meta_info"]["completion_tokens"] == 16


def test_bytes_on_the_wire_are_the_codec_sizes(servers: dict, tiny_model: Path) -> None:
    """The Anchor travels whole; the lossless Residual as many bytes as it coded, fewer than
    its space (the raw words), and decode counts what landed."""
    layout = kv_layout(tiny_model)
    for prefill, decode, codec, mode in (
        (servers["P"], servers["D1"], CodecConfig(residual="exact"), Mode.FULL),
        (servers["PA"], servers["DA"], CodecConfig(anchor_bits=2), Mode.ANCHOR_ONLY),
    ):
        before = state(decode)["lynx_transfer"]
        answer = pd_generate(prefill, decode, PROMPTS[3])
        after = state(decode)["lynx_transfer"]
        plan = RequestLayout(layout, codec, answer["meta_info"]["prompt_tokens"], mode)
        space = plan.sent_residual_nbytes
        residual = after["residual_bytes"] - before["residual_bytes"]
        assert after["anchor_bytes"] - before["anchor_bytes"] == plan.anchor_nbytes
        assert 0 < residual < space if space else residual == 0
        report = answer["meta_info"]["lynx_transfer"][0]
        assert (report["anchor_bytes"], report["residual_bytes"]) == (plan.anchor_nbytes, residual)
        assert report["residual_space"] == space
        assert report["anchor_latency_s"] > 0
        if residual:  # held HOLD_S on purpose: the Residual lands after the Anchor
            assert report["residual_latency_s"] >= HOLD_S


def test_anchor_only_runs_and_its_agreement_is_reported(servers: dict) -> None:
    agree = total = 0
    for prompt in PROMPTS:
        anchor = pd_generate(servers["PA"], servers["DA"], prompt)["output_ids"]
        plain = pd_generate(servers["P0"], servers["D0"], prompt)["output_ids"]
        assert len(anchor) == 16
        total += len(plain)
        agree += next((i for i, (a, b) in enumerate(zip(anchor, plain, strict=True)) if a != b), len(plain))
    print(f"\nanchor-only (2-bit Anchors, tiny model): greedy prefix agreement {agree}/{total} tokens")


# ---- pairing ----------------------------------------------------------------------------


def test_mismatched_settings_refuse_to_pair_naming_both(servers: dict) -> None:
    message = error_of(lambda: pd_generate(servers["P"], servers["DA"], "Hello"))
    assert "Lynx settings differ" in message
    assert "mode=full" in message and "mode=anchor-only" in message
    assert "anchor_bits=4" in message and "anchor_bits=2" in message


def test_lynx_on_one_side_only_is_refused(servers: dict) -> None:
    decode_without = error_of(lambda: pd_generate(servers["P"], servers["D0"], "Hello"))
    assert "without --lynx" in decode_without
    prefill_without = error_of(lambda: pd_generate(servers["P0"], servers["D1"], "Hello"))
    assert "--lynx" in prefill_without and "handshake" in prefill_without


def test_servers_keep_serving_after_refusals(servers: dict, idle_kv: dict) -> None:
    assert len(pd_generate(servers["P"], servers["D1"], "Hello")["output_ids"]) == 16
    wait_for(lambda: idle(servers["P"]) and idle(servers["D1"], idle_kv["D1"]), "idle")


# ---- faults -------------------------------------------------------------------------------


def _in_background(call: Callable[[], dict]) -> Future:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    return future


def _failure_of(future: Future) -> str:
    try:
        future.result(timeout=120)
    except urllib.error.HTTPError as exc:
        return exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return f"connection: {exc}"
    raise AssertionError("the request should have failed")


def test_aborted_request_frees_everything(servers: dict, idle_kv: dict) -> None:
    pending = _in_background(lambda: pd_generate(servers["P"], servers["D1"], PROMPTS[3], rid="lynx-abort"))
    # Abort while its Residual is held on prefill.
    wait_for(lambda: state(servers["D1"])["lynx_transfer"]["rooms"] == 1, "receiving")
    http_json(servers["D1"].url + "/abort_request", {"rid": "lynx-abort"})
    assert "Aborted" in _failure_of(pending)
    wait_for(lambda: idle(servers["P"]) and idle(servers["D1"], idle_kv["D1"]), "idle")
    assert len(pd_generate(servers["P"], servers["D1"], "Hello")["output_ids"]) == 16


def test_stalled_prefill_hits_the_deadline(servers: dict, idle_kv: dict) -> None:
    prefill, decode = servers["P"], servers["D1"]
    anchors_before = state(decode)["lynx_transfer"]["anchor_bytes"]
    pending = _in_background(lambda: pd_generate(prefill, decode, PROMPTS[3]))
    # The Anchor landed, the Residual is held on prefill: freeze prefill now.
    wait_for(lambda: state(decode)["lynx_transfer"]["anchor_bytes"] > anchors_before, "Anchor landed")
    signal_group(prefill, signal.SIGSTOP)
    try:
        message = _failure_of(pending)
    finally:
        signal_group(prefill, signal.SIGCONT)
    assert "Residual did not land within" in message and "--lynx-transfer-deadline" in message
    wait_for(lambda: idle(prefill) and idle(decode, idle_kv["D1"]), "idle", timeout_s=5 * DEADLINE_S)
    assert len(pd_generate(prefill, decode, "Hello")["output_ids"]) == 16


def test_decode_killed_mid_transfer_fails_only_its_request(servers: dict, idle_kv: dict) -> None:
    prefill, victim = servers["P"], servers["D2"]
    survivor = _in_background(lambda: pd_generate(prefill, servers["D1"], PROMPTS[3]))
    doomed = _in_background(lambda: pd_generate(prefill, victim, PROMPTS[3]))
    wait_for(lambda: state(victim)["lynx_transfer"]["rooms"] == 1, "receiving")
    _kill(victim)
    assert _failure_of(doomed)
    assert len(survivor.result(timeout=120)["output_ids"]) == 16
    wait_for(lambda: idle(prefill) and idle(servers["D1"], idle_kv["D1"]), "idle", timeout_s=5 * DEADLINE_S)
    assert len(pd_generate(prefill, servers["D1"], "Hello")["output_ids"]) == 16


def test_prefill_killed_mid_transfer_fails_only_its_request(servers: dict, idle_kv: dict) -> None:
    prefill, decode = servers["P"], servers["D1"]
    doomed = _in_background(lambda: pd_generate(prefill, decode, PROMPTS[3]))
    wait_for(lambda: state(decode)["lynx_transfer"]["rooms"] == 1, "receiving")
    _kill(prefill)
    assert _failure_of(doomed)
    # Upstream holds the request's KV pages until the dead prefill's drain ack, which never
    # comes: its deferred release gives up after the timeout (10 s here, see config).
    wait_for(lambda: idle(decode, idle_kv["D1"]), "idle", timeout_s=90)
    # The decode server serves on: a restarted prefill pairs with it again.
    prefill.start()
    assert len(pd_generate(prefill, decode, "Hello")["output_ids"]) == 16
    wait_for(lambda: idle(prefill) and idle(decode, idle_kv["D1"]), "idle")


def _kill(server: SingleServer) -> None:
    """SIGKILL, as a crash: no graceful drain, nothing told to the peers."""
    signal_group(server, signal.SIGKILL)
    server.stop()


def test_prometheus_metrics_count_transfers_and_failures(servers: dict) -> None:
    # After the tests above, D1 has received transfers and failed some (stall, abort,
    # killed prefill).
    with urllib.request.urlopen(servers["D1"].url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if (line.startswith("lynx_") and "_count{" in line)
        or line.startswith("lynx_transfer_failures_total{")
    }
    assert samples.get("lynx_anchor_bytes_count", 0) >= 5
    assert samples.get("lynx_residual_latency_seconds_count", 0) >= 5
    assert samples.get("lynx_transfer_failures_total", 0) >= 2
