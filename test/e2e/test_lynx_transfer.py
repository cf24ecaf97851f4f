"""Lynx's KV transfer between real prefill and decode servers: exactness, bytes, pairing,
faults.

Requests go straight to a prefill and a decode server with the bootstrap fields the
router would add, so each test picks the pair (and the failure) it needs. Servers, all
on the tiny model and started once for the module:

* ``P`` (prefill), ``D1``/``D2`` (decode): ``--lynx`` full mode with the exact residual,
  Residual writes held ``HOLD_S`` seconds (a slow link on demand: the window in which
  the fault tests strike); ``D1`` with ``--enable-metrics``;
* ``P0``/``D0``: plain PD without ``--lynx`` (the reference, and the peers without Lynx
  for the pairing tests): conftest's shared pair;
* ``PA``/``DA``: ``--lynx-mode anchor-only`` with 2-bit Anchors;
* ``DR``: as ``D2``, with decode's radix cache (``--disaggregation-decode-enable-radix-cache``),
  paired with ``P``;
* ``PL``: as ``P``, sending each chunk's Anchor layer by layer (``--lynx-layerwise-from``),
  paired with ``D2``.

All compute in FP32 over a BF16 KV pool, as the shared reference does (the KV that
crosses is a BF16 deployment's).

The router path (OpenAI API, streaming) with ``--lynx`` is in test_pd_cluster.py.
"""

from __future__ import annotations

import contextlib
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import SharedServers
from pdtools import (
    PROMPTS,
    Prefill,
    batch_variant,
    decode_server,
    error_of,
    flush_cache,
    idle,
    in_background,
    kv_layout,
    pd_generate,
    push_control,
    signal_group,
    state,
    wait_for,
)

from lynx.codec import CodecConfig
from lynx.mode import Mode
from lynx.tools import cluster
from lynx.tools.cluster import HOST, SingleServer, http_json, lynx_control_endpoint, pd_body
from lynx.transfer import RequestLayout
from lynx.transfer.protocol import TAG, Handshake, Notice, NoticeKind, Offer, Stream

pytestmark = pytest.mark.e2e

HOLD_S = 2.0
# Below upstream's dead-prefill detection (heartbeat every 5 s, two misses), so a stalled
# prefill is caught by Lynx's own deadline.
DEADLINE_S = 6.0
EXACT = ["--lynx", "--lynx-residual", "exact", "--lynx-transfer-deadline", str(DEADLINE_S)]
HELD = [*EXACT, "--lynx-residual-hold", str(HOLD_S)]
ANCHOR_ONLY = ["--lynx", "--lynx-mode", "anchor-only", "--lynx-anchor-bits", "2"]


SHARED_SERVERS = ("P0", "D0")


@pytest.fixture(scope="module")
def servers(
    request: pytest.FixtureRequest, shared: SharedServers, tiny_model: Path, log_dir: Path
) -> Iterator[dict[str, Any]]:
    # The shared reference computes in FP32 over a BF16 KV pool: so do these. A decode whose
    # prefill died holds the failed requests' pages for a drain ACK that never comes, until
    # upstream's release timeout (30 s by default): shorter here.
    config = batch_variant(tiny_model, {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "10"})
    own: dict[str, Any] = {
        "P": Prefill(config, log_dir, "P", HELD),
        "D1": decode_server(config, log_dir, "D1", [*HELD, "--enable-metrics"]),
        "D2": decode_server(config, log_dir, "D2", HELD),
        "PA": Prefill(config, log_dir, "PA", ANCHOR_ONLY),
        "PL": Prefill(config, log_dir, "PL", [*HELD, "--lynx-layerwise-from", "64"]),
        "DA": decode_server(config, log_dir, "DA", ANCHOR_ONLY),
        "DR": decode_server(
            replace(config, extra_args=[a for a in config.extra_args if a != "--disable-radix-cache"]),
            log_dir,
            "DR",
            [*HELD, "--disaggregation-decode-enable-radix-cache"],
        ),
    }
    with shared.running(request, own) as group:
        yield group


@pytest.fixture(scope="module")
def idle_kv(servers: dict) -> dict[str, int]:
    """Free KV tokens of each Lynx decode server before any test request."""
    return {name: state(servers[name])["lynx_kv_available_tokens"] for name in ("D1", "D2", "DA")}


# ---- exactness and bytes ---------------------------------------------------------------


def test_full_mode_with_exact_residual_equals_plain_pd(servers: dict, idle_kv: dict) -> None:
    for prompt in PROMPTS:
        lynx = pd_generate(servers["P"], servers["D1"], prompt)
        plain = pd_generate(servers["P0"], servers["D0"], prompt)
        assert lynx["output_ids"] == plain["output_ids"], prompt[:40]
        assert lynx["meta_info"]["completion_tokens"] == 16


def test_the_first_token_streams_before_the_kv_lands(servers: dict, idle_kv: dict) -> None:
    """Full mode with the Residual held ``HOLD_S``: the first token (prefill's, with its
    logprobs) streams as soon as prefill's aux data lands, the very chunk plain PD streams
    later; the rest follows once the KV has landed; the stream and its end are plain PD's."""
    extra = {"return_logprob": True, "top_logprobs_num": 3}

    def streamed(prefill: Prefill, decode: SingleServer, n: int) -> list[tuple[float, dict]]:
        chunks: list[tuple[float, dict]] = []
        body = pd_body(PROMPTS[3], prefill.bootstrap_port, n, extra=extra)
        started = time.monotonic()

        def arrived(chunk: dict) -> None:
            chunks.append((time.monotonic() - started, chunk))

        cluster.pd_generate(prefill.url, decode.url, body, 180, on_chunk=arrived)
        return chunks

    lynx, plain = streamed(servers["P"], servers["D1"], 6), streamed(servers["P0"], servers["D0"], 6)
    (first_at, first), (second_at, _) = lynx[:2]
    assert len(first["output_ids"]) == 1
    keys = ("output_token_logprobs", "output_top_logprobs", "prompt_tokens", "cached_tokens")
    assert [first["meta_info"][k] for k in keys] == [plain[0][1]["meta_info"][k] for k in keys]
    assert second_at - first_at > HOLD_S / 2, (first_at, second_at)  # it did not wait for the KV
    (_, last), (_, plain_last) = lynx[-1], plain[-1]
    assert last["output_ids"] == plain_last["output_ids"]
    assert last["meta_info"]["output_token_logprobs"] == plain_last["meta_info"]["output_token_logprobs"]
    assert last["meta_info"]["finish_reason"] == plain_last["meta_info"]["finish_reason"]
    report = last["meta_info"]["lynx_transfer"][-1]
    assert report["first_token_latency_s"] < report["residual_latency_s"] - HOLD_S / 2, report
    # A request that ends at its first token is answered as without Lynx (upstream answers
    # it from the batch it joins once its KV landed), whole and once.
    ones = [chunk for _, chunk in streamed(servers["P"], servers["D1"], 1)]
    assert [chunk["output_ids"] for chunk in ones] == [plain[0][1]["output_ids"]]
    assert ones[0]["meta_info"]["finish_reason"]["type"] == "length"
    wait_for(lambda: idle(servers["D1"], idle_kv["D1"]), "D1 idle")


def test_anchors_sent_layer_by_layer_during_prefill_change_no_byte_and_no_answer(
    servers: dict, tiny_model: Path
) -> None:
    """A prefill that sends each chunk's Anchor layer by layer as it computes (the
    ~500-token prompt: four chunks of 128, two segments) sends the bytes and checksums of
    one that sends each chunk once computed, and the answers equal plain PD's; prompts
    below ``--lynx-layerwise-from`` go chunk by chunk."""
    before = state(servers["PL"])["lynx_transfer"]
    for prompt in PROMPTS:
        layered = pd_generate(servers["PL"], servers["D2"], prompt)
        whole = pd_generate(servers["P"], servers["D2"], prompt)
        plain = pd_generate(servers["P0"], servers["D0"], prompt)
        assert layered["output_ids"] == whole["output_ids"] == plain["output_ids"], prompt[:40]
        sent = [a["meta_info"]["lynx_transfer"][-1] for a in (layered, whole)]
        assert [(s["anchor_bytes"], s["residual_bytes"]) for s in sent] == [
            (sent[1]["anchor_bytes"], sent[1]["residual_bytes"])
        ] * 2, prompt[:40]
    after = state(servers["PL"])["lynx_transfer"]
    layers = kv_layout(tiny_model).num_layers
    # Only the long prompt streams: its two segments complete in its 2nd and 4th chunks.
    assert after["layers_streamed"] - before["layers_streamed"] == 2 * layers
    assert after["layer_encode_s"] > before["layer_encode_s"]
    wait_for(lambda: idle(servers["D2"]), "D2 idle")


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


def test_decode_radix_cache_receives_only_the_tokens_it_lacks(servers: dict, tiny_model: Path) -> None:
    """With decode's radix cache on, decode asks prefill only for the tokens past the
    prefix it holds (upstream's ``decode_prefix_len``): Lynx sends their Anchor and
    Residual, nothing for a prompt decode holds whole (no room taken), and every answer
    equals plain PD's."""
    prefill, decode = servers["P"], servers["DR"]
    layout, codec = kv_layout(tiny_model), CodecConfig(residual="exact")
    prompt, longer = PROMPTS[3], PROMPTS[3] + "and they lived happily ever after, " * 8
    flush_cache(decode.url)
    answers = {
        "cold": pd_generate(prefill, decode, prompt),
        "held whole": pd_generate(prefill, decode, prompt),
        "extended": pd_generate(prefill, decode, longer),
    }
    flush_cache(decode.url)
    answers["extended, cold"] = pd_generate(prefill, decode, longer)
    plain = {text: pd_generate(servers["P0"], servers["D0"], text)["output_ids"] for text in (prompt, longer)}
    for name, answer in answers.items():
        assert answer["output_ids"] == plain[longer if "extended" in name else prompt], name
    sent = {name: a["meta_info"].get("lynx_transfer", [{}])[-1] for name, a in answers.items()}
    assert sent["held whole"] == {}  # no Lynx transfer at all
    prompt_tokens = answers["cold"]["meta_info"]["prompt_tokens"]
    longer_tokens = answers["extended"]["meta_info"]["prompt_tokens"]
    for name, tokens in (("cold", prompt_tokens), ("extended, cold", longer_tokens)):
        assert sent[name]["anchor_bytes"] == RequestLayout(layout, codec, tokens, Mode.FULL).anchor_nbytes
    # Only the tokens past the prefix decode held (page size 1: all of the first prompt).
    tail = RequestLayout(layout, codec, longer_tokens - prompt_tokens, Mode.FULL)
    assert sent["extended"]["anchor_bytes"] == tail.anchor_nbytes
    assert 0 < sent["extended"]["residual_bytes"] <= tail.sent_residual_nbytes
    flush_cache(decode.url)
    wait_for(lambda: idle(decode), "DR idle")


def test_parallel_samples_carry_the_prompt_once_to_a_decode_with_radix_cache(
    servers: dict, tiny_model: Path
) -> None:
    """n = 4 greedy, sent to both servers as the router sends it: four answers, each plain
    PD's. A decode with a radix cache receives the prompt's KV once, with the warm-up, and
    its samples none; one without receives it once per sample and none for the warm-up,
    which reads none of it."""
    layout, codec = kv_layout(tiny_model), CodecConfig(residual="exact")
    prompt = PROMPTS[3]
    single = pd_generate(servers["P0"], servers["D0"], prompt)
    once = RequestLayout(layout, codec, single["meta_info"]["prompt_tokens"], Mode.FULL).anchor_nbytes
    flush_cache(servers["DR"].url)
    for decode, prompts_sent in (("DR", 1), ("D2", 4)):
        before = state(servers[decode])["lynx_transfer"]
        samples = pd_generate(servers["P"], servers[decode], prompt, sampling={"n": 4})
        after = state(servers[decode])["lynx_transfer"]
        assert [s["output_ids"] for s in samples] == [single["output_ids"]] * 4, decode
        moved = {kind: after[kind] - before[kind] for kind in ("anchor_bytes", "residual_bytes")}
        print(f"n = 4 to {decode}: {moved} (the prompt's Anchor alone: {once})")
        assert moved["anchor_bytes"] == prompts_sent * once, decode
    flush_cache(servers["DR"].url)
    wait_for(lambda: idle(servers["DR"]) and idle(servers["D2"]), "DR and D2 idle")


def test_anchor_only_runs_and_its_agreement_is_reported(servers: dict, tiny_model: Path) -> None:
    """Anchor-only decodes on the Anchor alone: each answer is whole, its report shows the
    Anchor's bytes and no Residual, and its agreement with plain PD is measured (a 2-bit
    Anchor of a random tiny model agrees little: the figure is printed, not bounded)."""
    layout, codec = kv_layout(tiny_model), CodecConfig(anchor_bits=2)
    agree = total = 0
    for prompt in PROMPTS:
        answer = pd_generate(servers["PA"], servers["DA"], prompt)
        anchor = answer["output_ids"]
        plain = pd_generate(servers["P0"], servers["D0"], prompt)["output_ids"]
        assert len(anchor) == len(plain) == 16
        report = answer["meta_info"]["lynx_transfer"][-1]
        plan = RequestLayout(layout, codec, answer["meta_info"]["prompt_tokens"], Mode.ANCHOR_ONLY)
        assert (report["anchor_bytes"], report["residual_bytes"]) == (plan.anchor_nbytes, 0), report
        assert report["anchor_latency_s"] > 0
        total += len(plain)
        agree += next((i for i, (a, b) in enumerate(zip(anchor, plain, strict=True)) if a != b), len(plain))
    assert 0 <= agree <= total == 16 * len(PROMPTS)
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


# ---- hostile peers, hang-ups --------------------------------------------------------------


def test_what_no_peer_should_send_ends_no_server(servers: dict, idle_kv: dict, tiny_model: Path) -> None:
    """Garbage on either server's control socket (noise, a 32 MiB frame, metadata whose port
    is not a number or whose page ids are 5 bytes, forged Lynx notices) is dropped, and a
    well-formed offer for a live request whose receive space wraps past 2^64 fails that
    request alone: both servers serve on, exactly. Before, one frame of noise ended
    prefill's bootstrap thread (upstream's, fed by Lynx's hook), after which prefill,
    healthy to the router, took no request any more; and the hostile offer was accepted
    and ended prefill at its first write."""
    prefill, decode = servers["P"], servers["D1"]
    first = pd_generate(prefill, decode, PROMPTS[2])
    room, nonce = random.getrandbits(62), random.getrandbits(64)
    handshake = Handshake(Mode.FULL, CodecConfig(residual="exact"), kv_layout(tiny_model), checksums=True)
    n_tokens = first["meta_info"]["prompt_tokens"]
    sent = RequestLayout.sent_nbytes_of(handshake, n_tokens)
    wraps = Offer(
        handshake.to_wire(),
        nonce,
        (1 << 64) - 4096,
        sent[Stream.ANCHOR],
        1 << 40,
        sent[Stream.RESIDUAL],
        n_tokens,
    )
    metadata = [str(room).encode(), b"127.0.0.1", b"1", b"forged:1", b"\0" * 4 * n_tokens, b"0", b"", b"1"]
    # the request whose room the offer claims, on prefill alone
    body = {"text": PROMPTS[2], "bootstrap_host": HOST, "bootstrap_port": prefill.bootstrap_port}
    in_background(lambda: _post_quietly(prefill.url + "/generate", {**body, "bootstrap_room": room}))
    push_control(
        lynx_control_endpoint(prefill.processes[0].log_path),
        [
            [b"\xff" * 64],
            [b"7" * (32 << 20)],
            [*metadata[:2], b"port", *metadata[3:]],
            [*metadata[:4], b"12345", *metadata[5:]],
            [b"WATERMARK", b"1"],
            # room 2**64, twice (two nonces): it ended the bootstrap thread, no key needed
            [str(1 << 64).encode(), *metadata[1:], TAG, replace(wraps, nonce=1).to_wire()],
            [str(1 << 64).encode(), *metadata[1:], TAG, replace(wraps, nonce=2).to_wire()],
            [*metadata, TAG, wraps.to_wire()],
        ],
    )
    push_control(
        lynx_control_endpoint(decode.processes[0].log_path),
        [
            [b"\xff" * 64],
            [b"\xff" * (32 << 20)],
            [b"AUX_DATA", b"x"],
            [b"STAGING_REQ", b"1", b"0", b"0", b"s"],
            Notice(NoticeKind.LANDED, room, nonce=nonce, stream=Stream.RESIDUAL, nbytes=1 << 40).to_frames(),
            Notice(NoticeKind.RELEASED, room, nonce=nonce).to_frames(),
        ],
    )
    for server, said in ((prefill, "offered receive space no write can reach"), (decode, "unreadable")):
        log = server.processes[0].log_path
        wait_for(lambda log=log, said=said: said in log.read_text(errors="replace"), f"logged {said!r}")
    assert "unreadable control message" in prefill.processes[0].log_path.read_text(errors="replace")
    for _ in range(2):
        assert pd_generate(prefill, decode, PROMPTS[2])["output_ids"] == first["output_ids"]
    wait_for(lambda: idle(prefill) and idle(decode, idle_kv["D1"]), "idle")


def _post_quietly(url: str, body: dict) -> dict:
    with contextlib.suppress(urllib.error.URLError, OSError):
        return http_json(url, body, timeout=120)
    return {}


def test_clients_that_hang_up_leave_nothing_behind(servers: dict, idle_kv: dict) -> None:
    """32 clients send a request each and hang up within 0.3-2 s: some while decode waits
    for KV space (their prompts need more than its pool), some while the Anchor or the held
    Residual crosses. Upstream aborts each on both servers; every page, buffer byte and room
    comes back, and the next request is exact."""
    prefill, decode = servers["P"], servers["D1"]
    expected = pd_generate(prefill, decode, PROMPTS[3])["output_ids"]
    rng = random.Random(26)
    patience = [rng.uniform(0.3, 2.0) for _ in range(32)]

    def hang_up(i: int) -> str:
        try:
            pd_generate(prefill, decode, PROMPTS[i % len(PROMPTS)], timeout_s=patience[i])
        except (TimeoutError, urllib.error.URLError) as exc:
            return type(exc).__name__
        return "answered"

    with ThreadPoolExecutor(len(patience)) as pool:
        outcomes = list(pool.map(hang_up, range(len(patience))))
    last_hang_up = time.monotonic()
    assert outcomes.count("answered") < len(outcomes) // 2, outcomes
    # Upstream notices a client gone only between its waits for the answer
    # (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s by default): it aborts the request from there.
    wait_for(lambda: idle(prefill) and idle(decode, idle_kv["D1"]), "idle after the hang-ups", timeout_s=90)
    print(f"idle {time.monotonic() - last_hang_up:.1f} s after the last client hung up")
    assert pd_generate(prefill, decode, PROMPTS[3])["output_ids"] == expected


# ---- faults -------------------------------------------------------------------------------


def _failure_of(future: Future) -> str:
    try:
        future.result(timeout=120)
    except urllib.error.HTTPError as exc:
        return exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return f"connection: {exc}"
    raise AssertionError("the request should have failed")


def test_aborted_request_frees_everything(servers: dict, idle_kv: dict) -> None:
    pending = in_background(lambda: pd_generate(servers["P"], servers["D1"], PROMPTS[3], rid="lynx-abort"))
    # Abort while its Residual is held on prefill.
    wait_for(lambda: state(servers["D1"])["lynx_transfer"]["rooms"] == 1, "receiving")
    http_json(servers["D1"].url + "/abort_request", {"rid": "lynx-abort"})
    aborted = time.monotonic()
    assert "Aborted" in _failure_of(pending)
    wait_for(lambda: idle(servers["P"]) and idle(servers["D1"], idle_kv["D1"]), "idle")
    print(f"idle {time.monotonic() - aborted:.1f} s after the abort (polled every 0.5 s)")
    assert len(pd_generate(servers["P"], servers["D1"], "Hello")["output_ids"]) == 16


def test_stalled_prefill_hits_the_deadline(servers: dict, idle_kv: dict) -> None:
    prefill, decode = servers["P"], servers["D1"]
    anchors_before = state(decode)["lynx_transfer"]["anchor_bytes"]
    pending = in_background(lambda: pd_generate(prefill, decode, PROMPTS[3]))
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
    survivor = in_background(lambda: pd_generate(prefill, servers["D1"], PROMPTS[3]))
    doomed = in_background(lambda: pd_generate(prefill, victim, PROMPTS[3]))
    wait_for(lambda: state(victim)["lynx_transfer"]["rooms"] == 1, "receiving")
    _kill(victim)
    assert _failure_of(doomed)
    assert len(survivor.result(timeout=120)["output_ids"]) == 16
    wait_for(lambda: idle(prefill) and idle(servers["D1"], idle_kv["D1"]), "idle", timeout_s=5 * DEADLINE_S)
    assert len(pd_generate(prefill, servers["D1"], "Hello")["output_ids"]) == 16


def test_prefill_killed_mid_transfer_fails_only_its_request(servers: dict, idle_kv: dict) -> None:
    prefill, decode = servers["P"], servers["D1"]
    doomed = in_background(lambda: pd_generate(prefill, decode, PROMPTS[3]))
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
