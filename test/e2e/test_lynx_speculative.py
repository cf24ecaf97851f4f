"""``--lynx-mode speculative`` between real prefill and decode servers: decoding on the
Anchor, held tokens, one-pass verification, rollback, exactness, faults.

Servers, started once for the module, and (conftest's ``SharedServers``) shared with
other modules:

* ``PS``/``DS`` (shared): speculative, exact residual, held back so every request
  speculates on 2-bit Anchors, whose held tokens are often wrong (its output and logprobs
  must equal plain PD's bit for bit); ``DS`` with ``--enable-metrics``;
* ``P0``/``D0`` (shared): plain PD without Lynx (the reference); both pairs compute in
  FP32 over a BF16 KV pool (``pdtools.batch_variant``: only a verify pass that computes
  each held row as its decode step did can equal plain PD there);
* ``PI``/``DI``: speculative, INT8 residual; ``DI`` retracts every few steps
  (``SGLANG_TEST_RETRACT``), which parks speculating requests;
* ``PF``/``DF``: ``full`` mode, INT8 residual (the reference for ``DI`` and ``DP``);
* ``PP``/``DP``: speculative, INT8 residual, protected first and last tokens.

Every decode server runs upstream's strict idle memory check and KV page invariants, and
its default overlap scheduler (the non-overlap loop is exercised by test_pd_cluster.py
and test_qwen.py).
"""

from __future__ import annotations

import random
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import SharedServers
from pdtools import (
    CHECKS,
    COMMON,
    SPEC_CAP,
    SPEC_DEADLINE_S,
    SPEC_EXACT,
    Prefill,
    bf16_batch_variance,
    decode_server,
    error_of,
    idle,
    pd_generate,
    signal_group,
    speculation,
    state,
    wait_for,
)
from pdtools import (
    PROMPTS as COMMON_PROMPTS,
)

from lynx.tools import cluster
from lynx.tools.cluster import ServerConfig, http_json, pd_body

pytestmark = pytest.mark.e2e

SHARED_SERVERS = ("PS", "DS", "P0", "D0")
SPEC = [*SPEC_EXACT, "--lynx-residual", "int8"]
# Protected tokens (key blocks of 16): a short prompt is covered whole, a long one keeps
# its first 16 and last 32 tokens exact on the Anchor lane.
SPEC_PROTECTED = [*SPEC, "--lynx-protect-first", "16", "--lynx-protect-last", "32"]
FULL_INT8 = [
    "--lynx",
    "--lynx-anchor-bits",
    "2",
    "--lynx-residual",
    "int8",
    "--lynx-transfer-deadline",
    str(SPEC_DEADLINE_S),
]
PROMPTS = [*COMMON_PROMPTS, "In a hole in the ground there lived"]


@pytest.fixture(scope="module")
def servers(
    request: pytest.FixtureRequest, shared: SharedServers, tiny_model: Path, log_dir: Path
) -> Iterator[dict[str, Any]]:
    config = ServerConfig(model_path=tiny_model, max_total_tokens=4096, extra_args=COMMON, env=CHECKS)
    retracting = ServerConfig(
        model_path=tiny_model,
        max_total_tokens=4096,
        extra_args=COMMON,
        env={**CHECKS, "SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5"},
    )
    own: dict[str, Any] = {
        "PI": Prefill(config, log_dir, "PI", SPEC),
        "DI": decode_server(retracting, log_dir, "DI", [*SPEC]),
        "PF": Prefill(config, log_dir, "PF", FULL_INT8),
        "DF": decode_server(config, log_dir, "DF", FULL_INT8),
        "PP": Prefill(config, log_dir, "PP", SPEC_PROTECTED),
        "DP": decode_server(config, log_dir, "DP", [*SPEC_PROTECTED]),
    }
    with shared.running(request, own) as group:
        yield group


@pytest.fixture(scope="module")
def idle_kv(servers: dict) -> dict[str, int]:
    return {name: state(servers[name])["lynx_kv_available_tokens"] for name in ("DS", "DI")}


def concurrently(calls: list[Any]) -> list[dict]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


# ---- exactness ---------------------------------------------------------------------------


def test_speculative_with_exact_residual_equals_plain_pd(servers: dict, idle_kv: dict) -> None:
    reports = []
    for prompt in PROMPTS:
        spec = pd_generate(servers["PS"], servers["DS"], prompt, max_new_tokens=24)
        plain = pd_generate(servers["P0"], servers["D0"], prompt, max_new_tokens=24)
        assert spec["output_ids"] == plain["output_ids"], prompt[:40]
        assert spec["meta_info"]["completion_tokens"] == 24
        reports.append(speculation(spec))
    print("speculation per prompt:", reports)
    assert {r["park_reason"] for r in reports} == {"cap"}
    # Under the overlap loop a request parked at the cap still gets the token of the step
    # launched before the park: held, and verified with the rest.
    assert any(r["held"] == r["window"] + 1 for r in reports)
    # Speculation happened, held tokens were both kept and thrown away, and yet the
    # output is exact.
    assert all(r["held"] > 0 for r in reports)
    assert any(r["rejected"] for r in reports)
    assert any(r["accepted"] > 0 for r in reports)
    # The Residual's layers land spread over the hold (--lynx-residual-hold): a parked
    # request's rows ran through the first ones as they landed (--lynx-verify-pass layers,
    # the default), and its verify pass computed the rest; the output is exact all the same.
    assert all(r["verified_ahead_layers"] > 0 for r in reports), reports
    wait_for(lambda: idle(servers["DS"], idle_kv["DS"]), "idle")


def test_speculative_equals_full_mode_under_batch_mixes(
    servers: dict, idle_kv: dict, tiny_model: Path
) -> None:
    """Concurrent requests of different lengths and limits share decode batches with one
    another on Anchor KV, get parked at the cap or at max_new_tokens, are verified
    together, and some are retracted/parked by upstream's retraction drill."""
    lengths = [24, 5, 12, 24, 3, 17]

    def run(prefill: str, decode: str, prompt: str, n: int) -> Any:
        return lambda: pd_generate(servers[prefill], servers[decode], prompt, max_new_tokens=n)

    parked, differ = [], []
    for shift in (0, 3):
        pairs = [(PROMPTS[(i + shift) % len(PROMPTS)], n) for i, n in enumerate(lengths)]
        spec = concurrently([run("PI", "DI", p, n) for p, n in pairs])
        full = concurrently([run("PF", "DF", p, n) for p, n in pairs])
        for (prompt, n), a, b in zip(pairs, spec, full, strict=True):
            assert a["meta_info"]["completion_tokens"] == n
            parked.append(speculation(a).get("park_reason"))
            if (got := a["output_ids"]) != (want := b["output_ids"]):
                first = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
                differ.append((prompt[:20], n, f"from token {first}", speculation(a)))
    print("park reasons:", parked)
    assert "memory" in parked  # upstream's retraction drill hit batches with speculating requests
    wait_for(lambda: idle(servers["DI"], idle_kv["DI"]), "idle")
    if differ and (variance := bf16_batch_variance(tiny_model)) is not None:
        # Neither run is wrong: full mode's own output depends on its batches here.
        pytest.xfail(f"this host's {variance}; outputs differ under concurrency: {differ}")
    assert not differ, differ


def test_protected_tokens_keep_the_output_of_full_mode(servers: dict) -> None:
    """Protection changes what the draft decodes on, not what is committed: the refined KV
    is the same INT8 reconstruction as ``full`` mode's, protected tokens included."""
    for prompt in (PROMPTS[3], PROMPTS[1]):
        protected = pd_generate(servers["PP"], servers["DP"], prompt, max_new_tokens=24)
        full = pd_generate(servers["PF"], servers["DF"], prompt, max_new_tokens=24)
        assert protected["output_ids"] == full["output_ids"], prompt[:40]
        report = protected["meta_info"]["lynx_transfer"][0]
        if prompt is PROMPTS[3]:  # ~500 tokens: most of it travels as Anchor + Residual
            assert speculation(protected)["held"] > 0
            assert report["residual_bytes"] > 0
        else:  # covered whole: full precision with the Anchor, nothing to speculate on
            assert report["residual_bytes"] == 0
            assert "speculation" not in report


def test_a_stop_among_held_tokens_finishes_only_after_verification(servers: dict) -> None:
    prompt = PROMPTS[1]
    reference = pd_generate(servers["P0"], servers["D0"], prompt, max_new_tokens=24)["output_ids"]
    # a token first decoded on the Anchor (held), within the first CAP tokens
    stop = next(t for i, t in enumerate(reference) if 3 <= i < SPEC_CAP and t not in reference[:i])
    sampling = {"ignore_eos": False, "stop_token_ids": [stop]}
    spec = pd_generate(servers["PS"], servers["DS"], prompt, max_new_tokens=24, sampling=sampling)
    plain = pd_generate(servers["P0"], servers["D0"], prompt, max_new_tokens=24, sampling=sampling)
    assert spec["output_ids"] == plain["output_ids"]
    assert spec["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert spec["meta_info"]["completion_tokens"] == plain["meta_info"]["completion_tokens"]
    # Whether the 2-bit draft itself hit the stop (deferred finish, park_reason "finish") or
    # only the verified run did (found by the finish check over the committed run), the
    # request ends where full precision ends it.
    print("stop case:", speculation(spec))
    assert speculation(spec)["held"] > 0
    # max_new_tokens reached among held tokens: a deferred finish, whatever the draft holds
    short = pd_generate(servers["PS"], servers["DS"], prompt, max_new_tokens=4)
    assert short["output_ids"] == reference[:4]
    assert short["meta_info"]["finish_reason"]["type"] == "length"
    assert speculation(short)["park_reason"] == "finish"


def test_streaming_sends_only_committed_tokens(servers: dict) -> None:
    prompt = PROMPTS[4]
    chunks: list[dict] = []
    body = pd_body(prompt, servers["PS"].bootstrap_port, 24)
    cluster.pd_generate(servers["PS"].url, servers["DS"].url, body, 180, on_chunk=chunks.append)
    plain = pd_generate(servers["P0"], servers["D0"], prompt, max_new_tokens=24)["output_ids"]
    # Each chunk carries the output so far: never a token that is later withdrawn.
    assert chunks and chunks[-1]["output_ids"] == plain
    for chunk in chunks:
        assert plain[: len(chunk["output_ids"])] == chunk["output_ids"], chunk["output_ids"]
    assert len(chunks[0]["output_ids"]) == 1  # the exact first token went out before verification
    # The last chunk adds the final report; a first chunk that left after the Anchor landed
    # carried it as it stood then (one that left before, as prefill's aux data landed, none).
    *first, final = chunks[-1]["meta_info"]["lynx_transfer"]
    assert final["residual_bytes"] > 0 and final["speculation"]["held"] > 0, final
    assert [report["anchor_bytes"] for report in first] in ([], [final["anchor_bytes"]])


# ---- sampling ----------------------------------------------------------------------------


def test_sampled_requests_speculate_and_unverifiable_ones_wait(servers: dict, idle_kv: dict) -> None:
    # Temperature alone and with top-k / top-p / min-p filtering (what OpenAI clients send):
    # both speculate, verified by the speculative-sampling rule on the filtered distributions.
    for sampling in ({"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.5, "top_k": 20, "min_p": 0.05}):
        sampled = pd_generate(servers["PS"], servers["DS"], PROMPTS[2], max_new_tokens=16, sampling=sampling)
        assert sampled["meta_info"]["completion_tokens"] == 16
        assert speculation(sampled)["held"] > 0, sampling
    before = state(servers["DS"])["lynx_transfer"]["speculation"]["waited"]
    penalised = pd_generate(
        servers["PS"], servers["DS"], PROMPTS[2], max_new_tokens=16, sampling={"frequency_penalty": 0.5}
    )
    assert penalised["meta_info"]["completion_tokens"] == 16
    assert speculation(penalised)["held"] == 0
    assert state(servers["DS"])["lynx_transfer"]["speculation"]["waited"] == before + 1
    wait_for(lambda: idle(servers["DS"], idle_kv["DS"]), "idle")


LOGPROBS = {"return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [5, 17]}


def test_logprobs_of_speculated_tokens_equal_plain_pds(servers: dict, idle_kv: dict) -> None:
    """A request asking for logprobs speculates; the logprobs it returns for every token
    (including corrections after rejected held tokens) are the verify pass's, which runs
    the held rows as decode steps: equal to plain PD's bit for bit."""
    rejected = 0
    for prompt in PROMPTS[:4]:
        spec = pd_generate(servers["PS"], servers["DS"], prompt, max_new_tokens=24, extra=LOGPROBS)
        plain = pd_generate(servers["P0"], servers["D0"], prompt, max_new_tokens=24, extra=LOGPROBS)
        assert spec["output_ids"] == plain["output_ids"], prompt[:40]
        assert speculation(spec)["held"] > 0
        rejected += speculation(spec)["rejected"]
        ours, theirs = spec["meta_info"], plain["meta_info"]
        assert [t for _, t, _ in ours["output_token_logprobs"]] == spec["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            assert len(ours[key]) == len(theirs[key]) == 24, key
            assert ours[key] == theirs[key], (prompt[:40], key)
    assert rejected > 0  # corrections carry the verify pass's logprobs too
    sampled = pd_generate(
        servers["PS"], servers["DS"], PROMPTS[2], 16, sampling={"temperature": 0.8}, extra=LOGPROBS
    )
    assert speculation(sampled)["held"] > 0
    assert [t for _, t, _ in sampled["meta_info"]["output_token_logprobs"]] == sampled["output_ids"]
    wait_for(lambda: idle(servers["DS"], idle_kv["DS"]), "idle")


# ---- faults ------------------------------------------------------------------------------


def test_abort_while_speculating_frees_everything(servers: dict, idle_kv: dict) -> None:
    rid = f"abort-{random.getrandbits(32)}"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(pd_generate, servers["PS"], servers["DS"], PROMPTS[3], 64, rid)
        wait_for(
            lambda: state(servers["DS"])["lynx_transfer"]["speculation"]["active"] > 0, "speculating", 30
        )
        http_json(servers["DS"].url + "/abort_request", {"rid": rid})
        try:
            answer = pending.result()
            assert answer["meta_info"]["finish_reason"]["type"] == "abort"
            # the client never sees a held (unverified) token
            assert answer["meta_info"]["completion_tokens"] <= 1
        except urllib.error.HTTPError:
            pass
    wait_for(lambda: idle(servers["DS"], idle_kv["DS"]), "idle after the abort")
    assert pd_generate(servers["PS"], servers["DS"], PROMPTS[0])["meta_info"]["completion_tokens"] == 16


def test_a_residual_that_never_lands_fails_only_its_request(servers: dict, idle_kv: dict) -> None:
    prefill = servers["PS"]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(error_of, lambda: pd_generate(prefill, servers["DS"], PROMPTS[3], 32))
        wait_for(
            lambda: state(servers["DS"])["lynx_transfer"]["speculation"]["active"] > 0, "speculating", 30
        )
        signal_group(prefill, signal.SIGSTOP)  # the Residual write is being held: it never lands
        try:
            error = pending.result(timeout=120)
        finally:
            signal_group(prefill, signal.SIGCONT)
    assert "Residual did not land" in error, error
    wait_for(
        lambda: idle(servers["DS"], idle_kv["DS"]),
        "idle after the deadline",
        timeout_s=3 * SPEC_DEADLINE_S + 30,
    )
    assert pd_generate(prefill, servers["DS"], PROMPTS[0])["meta_info"]["completion_tokens"] == 16


# ---- metrics -----------------------------------------------------------------------------


def test_speculation_is_counted(servers: dict) -> None:
    stats = state(servers["DS"])["lynx_transfer"]["speculation"]
    assert stats["held_tokens"] > stats["accepted_tokens"] > 0
    assert stats["rejections"] > 0 and stats["verify_passes"] > 0
    assert 0 < stats["acceptance_rate"] < 1
    assert stats["failed"] >= 1  # the Residual that never landed
    with urllib.request.urlopen(servers["DS"].url + "/metrics", timeout=30) as response:
        metrics = response.read().decode()
    for name in (
        "lynx_held_tokens",
        "lynx_accepted_tokens",
        "lynx_verify_seconds",
        "lynx_anchor_to_commit_seconds",
    ):
        assert name in metrics, name
