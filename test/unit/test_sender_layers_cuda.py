"""Layer-by-layer Anchors from a CUDA pool: each layer's encode is enqueued on the forward's
stream after that layer's KV write, and its writes leave once the encode is done, without
the forward waiting. Needs a CUDA device: the GPU check's ``codec`` step runs this file
(CPU CI has no CUDA events to order by; the CPU path is tested in
``test_transfer_sender_receiver.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import test_transfer_sender_receiver as harness
import torch
from test_transfer_sender_receiver import LAYERS, LAYOUT, N_TOKENS, Pair, assert_rows_equal, wait_for

from lynx.codec import CodecConfig
from lynx.mode import Mode
from lynx.transfer import RequestLayout, Verdict, page_slots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pairs = harness.pairs  # the harness's fixture: closes every pair's sender

# GPU clock cycles a "layer" computes before writing its KV: tens of milliseconds, far
# longer than the host takes to launch every layer and its encode.
LAYER_CYCLES = 50_000_000


def _compute_chunk(pair: Pair, slots: torch.Tensor, kv: tuple[list, list]) -> None:
    """Prefill's forward on its own stream: each layer computes, writes its KV into the
    chunk's slots, then calls layer_done, all enqueued on that stream, none waited for."""
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        for layer in range(LAYERS):
            torch.cuda._sleep(LAYER_CYCLES)
            pair.prefill_k[layer][slots] = kv[0][layer]
            pair.prefill_v[layer][slots] = kv[1][layer]
            pair.sender.layer_done(layer)


def _chunk_kv(pair: Pair, slots: torch.Tensor) -> tuple[list, list]:
    """The KV the forward will write (taken from the pool, which then forgets it)."""
    kv = ([k[slots].clone() for k in pair.prefill_k], [v[slots].clone() for v in pair.prefill_v])
    for layer in range(LAYERS):
        pair.prefill_k[layer][slots] = 0
        pair.prefill_v[layer][slots] = 0
    return kv


def test_a_layers_anchor_leaves_once_its_encode_after_the_kv_write_is_done(
    pairs: Callable[..., Pair],
) -> None:
    """Every layer's Anchor leaves during the forward (before add_chunk), and decode holds
    exactly the KV the forward wrote: a write that left before its encode ran (or an encode
    ordered before its KV write) would carry the zeros the pool held before."""
    pair = pairs(device="cuda", layerwise_from=1)
    offer = pair.offer(60)
    pages = pair.pages(seed=60)
    slots = page_slots(pages, 1)[:N_TOKENS].cuda()
    kv = _chunk_kv(pair, slots)
    assert pair.sender.begin_chunk(60, pages)
    _compute_chunk(pair, slots, kv)
    anchor = RequestLayout(LAYOUT, CodecConfig(), N_TOKENS, Mode.FULL).anchor_nbytes
    wait_for(lambda: pair.sender.stats().anchor_bytes == anchor, "every layer's Anchor to leave")
    pair.chunk(60, offer, pages, True)
    pair.wait_verdict(60, Verdict.READY)
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(60, dst)
    assert_rows_equal(pair.decode_rows(dst), ([k.cpu() for k in kv[0]], [v.cpu() for v in kv[1]]))
    assert pair.sender.stats().layers_streamed == LAYERS


def test_a_non_finite_value_streamed_unchecked_fails_the_request_before_decode_uses_it(
    pairs: Callable[..., Pair],
) -> None:
    """The device encode reads nothing back, so a NaN leaves in a meaningless Anchor; the
    chunk's own encode then finds it, and the request fails, naming it, never READY."""
    pair = pairs(device="cuda", layerwise_from=1)
    offer = pair.offer(61)
    pages = pair.pages(seed=61)
    slots = page_slots(pages, 1)[:N_TOKENS].cuda()
    kv = _chunk_kv(pair, slots)
    kv[1][2][7, 1, 5] = float("nan")
    assert pair.sender.begin_chunk(61, pages)
    _compute_chunk(pair, slots, kv)
    pair.chunk(61, offer, pages, True)
    [(room, reason)] = pair.failures
    assert room == 61 and "nan in layer 2 values at token 7" in reason
    assert pair.wait_verdict(61, Verdict.FAIL) is not None
