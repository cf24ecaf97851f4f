"""Lynx with tensor parallelism: every TP rank encodes, sends and decodes its own KV heads,
and a speculative decode server's ranks agree on every decision (admit, park, verify,
commit, fail), so they never launch different batches.

Servers, on the tiny model (2 KV heads: one per rank at ``--tp-size 2``), started once
for the module; the speculative ones run upstream's default overlap scheduler:

* ``P0``/``D0``: plain BF16 PD at TP 2 (the reference: outputs at TP 2 differ from TP 1
  after some tokens on this random-weight model, so compare at equal TP);
* ``PS``/``DS``: speculative, exact residual, the Residual held back so every request
  speculates, 2-bit Anchors so held tokens are often rejected, at TP 2; ``PS`` sends
  each chunk's Anchor layer by layer (``--lynx-layerwise-from 64``), each rank its heads;
* ``P1``/``D1``: Lynx with the same Anchor and Residual at TP 1, the peers of the mixed-TP
  pairing tests: conftest's shared speculative pair.

On the CPU engine TP 2 needs ``SGLANG_CPU_OMP_THREADS_BIND`` (one core per rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import SharedServers
from pdtools import (
    CHECKS,
    COMMON,
    PROMPTS,
    Prefill,
    decode_server,
    error_of,
    idle,
    pd_generate,
    speculation,
    state,
    wait_for,
)

from lynx.tools.cluster import ServerConfig

pytestmark = pytest.mark.e2e

SPEC = [
    "--lynx",
    "--lynx-mode",
    "speculative",
    "--lynx-residual",
    "exact",
    "--lynx-anchor-bits",
    "2",
    "--lynx-max-speculative-tokens",
    "8",
    # Generous: Mooncake 0.3.13.post1's TCP transport now and then leaves one write pending
    # for seconds under load (both TP ranks at once; 4 in ~180 requests at an 8 s deadline),
    # and no test here is about deadlines.
    "--lynx-transfer-deadline",
    "30",
    # Long enough that a decode scheduler slowed by a busy CI host (a 4.4 s stall was
    # seen) still admits every request on its Anchor before the Residual lands.
    "--lynx-residual-hold",
    "4",
]


SHARED_SERVERS = {"P1": "PS", "D1": "DS"}


@pytest.fixture(scope="module")
def servers(
    request: pytest.FixtureRequest, shared: SharedServers, tiny_model: Path, log_dir: Path
) -> Iterator[dict[str, Any]]:
    def config(tp: int) -> ServerConfig:
        return ServerConfig(
            model_path=tiny_model,
            max_total_tokens=4096,
            # The KV pool's dtype named as the shared TP 1 peers name it: upstream compares the
            # flag's text when a prefill pairs, and a decode that finds "auto" against "bf16"
            # (the same dtype) raises in its scheduler loop and exits.
            extra_args=[*COMMON, "--kv-cache-dtype", "bf16", "--tp-size", str(tp)],
            env={**CHECKS, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else CHECKS,
        )

    group: dict[str, Any] = {
        "P0": Prefill(config(2), log_dir, "P0", []),
        "D0": decode_server(config(2), log_dir, "D0", []),
        "PS": Prefill(config(2), log_dir, "PS", [*SPEC, "--lynx-layerwise-from", "64"]),
        "DS": decode_server(config(2), log_dir, "DS", SPEC),
    }
    with shared.running(request, group) as everything:
        yield everything


@pytest.fixture(scope="module")
def idle_kv(servers: dict) -> dict[str, int]:
    return {name: state(servers[name])["lynx_kv_available_tokens"] for name in ("DS", "D1")}


def test_speculative_at_tp2_equals_plain_pd_at_tp2(servers: dict, idle_kv: dict) -> None:
    """Concurrent requests speculate on both ranks' Anchors (sent layer by layer as prefill
    computes them), are verified once both ranks' Residuals landed, and commit the same
    tokens on both ranks: exactly plain PD's."""
    lengths = [24, 5, 12, 24, 17]
    streamed = state(servers["PS"])["lynx_transfer"]["layers_streamed"]

    def run(prefill: str, decode: str) -> list[dict]:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            calls = [
                pool.submit(pd_generate, servers[prefill], servers[decode], prompt, n)
                for prompt, n in zip(PROMPTS, lengths, strict=True)
            ]
            return [call.result() for call in calls]

    spec, plain = run("PS", "DS"), run("P0", "D0")
    assert state(servers["PS"])["lynx_transfer"]["layers_streamed"] > streamed
    for prompt, n, a, b in zip(PROMPTS, lengths, spec, plain, strict=True):
        assert a["output_ids"] == b["output_ids"], prompt[:40]
        assert a["meta_info"]["completion_tokens"] == n
    reports = [speculation(a) for a in spec]
    print("speculation per prompt at TP 2:", reports)
    # Several requests speculated together (the ranks agreed on more than one at a time). A
    # request the busy 2-core decode admits only after its Residual landed rightly holds
    # nothing, so not every one must.
    assert sum(r["held"] > 0 for r in reports) >= 2
    assert any(r["rejected"] for r in reports) and any(r["accepted"] > 0 for r in reports)
    wait_for(lambda: idle(servers["DS"], idle_kv["DS"]), "idle")


def test_sampled_requests_at_tp2_commit_the_same_tokens_on_every_rank(servers: dict, idle_kv: dict) -> None:
    """The acceptance rule's coin flips are drawn from the ranks' shared seed, so the ranks
    commit the same tokens: ranks that did not would run batches of different lengths
    (hanging or failing the server) or stream rank 0's tokens over KV of other tokens."""
    for sampling in ({"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.5, "top_k": 20}):
        answers = [
            pd_generate(servers["PS"], servers["DS"], prompt, 16, sampling=sampling)
            for prompt in PROMPTS[1:4]
        ]
        assert all(a["meta_info"]["completion_tokens"] == 16 for a in answers)
        assert any(speculation(a)["held"] > 0 for a in answers)
    wait_for(lambda: idle(servers["DS"], idle_kv["DS"]), "idle")
    assert pd_generate(servers["PS"], servers["DS"], PROMPTS[0], 4)["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("prefill", "decode", "sizes"),
    [("PS", "D1", (2, 1)), ("P1", "DS", (1, 2))],
    ids=["tp2-to-tp1", "tp1-to-tp2"],
)
def test_mixed_tp_is_refused_naming_both_sizes(
    servers: dict, idle_kv: dict, prefill: str, decode: str, sizes: tuple[int, int]
) -> None:
    error = error_of(lambda: pd_generate(servers[prefill], servers[decode], PROMPTS[1], 8))
    theirs, ours = sizes
    assert f"splits the KV heads over {theirs} TP rank(s), this decode server over {ours}" in error, error
    assert "--tp-size" in error
    # Nothing is left behind on either side, and both serve their own kind on.
    wait_for(lambda: idle(servers[decode], idle_kv[decode]), "decode idle")
    wait_for(lambda: idle(servers[prefill]), "prefill idle")
    same = {"PS": "DS", "P1": "D1"}[prefill]
    assert pd_generate(servers[prefill], servers[same], PROMPTS[0], 4)["meta_info"]["completion_tokens"] == 4
