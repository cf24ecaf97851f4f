"""The scheduler, its queues, batches and KV pool, as Lynx's hooks reach them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from lynx_patches.errors import LynxConfigError
from lynx_patches.upstream.contract import (
    BATCH,
    REQ,
    SCHEDULE_BATCH,
    SCHEDULER,
    Relied,
    attribute,
    method,
    relies,
)

_DECODE = "sglang.srt.disaggregation.decode"
_INTERNAL_STATE_CONTROLLER = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
)

RELIED: tuple[Relied, ...] = (
    # What the accessors below do not declare themselves: the queue, batch and scheduler
    # methods Lynx's hooks wrap and the fields the hook modules read directly.
    method("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue", "_init_kv_manager"),
    method(f"{_DECODE}.DecodePreallocQueue", "_init_kv_manager"),
    method(f"{_DECODE}.DecodePreallocQueue", "_send_kv_metadata", "decode_req", "kv_indices", "page_size"),
    method(f"{_DECODE}.DecodeTransferQueue", "_commit_transfer_to_req", "decode_req"),
    attribute(f"{_DECODE}.DecodeRequest", "req"),
    attribute(f"{_DECODE}.DecodeRequest", "kv_receiver"),
    method(BATCH, "is_empty"),
    method(BATCH, "retract_decode"),
    method(SCHEDULER, "is_fully_idle"),
    method(SCHEDULER, "collect_inflight_reqs"),
    attribute(SCHEDULER, "disagg_prefill_bootstrap_queue"),
    attribute(SCHEDULER, "disagg_decode_prealloc_queue"),
    attribute("sglang.srt.managers.io_struct.GetInternalStateReqOutput", "internal_state"),
)


@relies(
    attribute(f"{_DECODE}.DecodePreallocQueue", "scheduler"),
    attribute(f"{_DECODE}.DecodeTransferQueue", "scheduler"),
)
def queue_scheduler(queue: Any) -> Any:
    return queue.scheduler


@relies(attribute(_INTERNAL_STATE_CONTROLLER, "scheduler"))
def controller_scheduler(controller: Any) -> Any:
    """The scheduler whose ``/server_info`` internal state ``controller`` answers with."""
    return controller.scheduler


@relies(
    attribute("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue", "token_to_kv_pool"),
    attribute("sglang.srt.disaggregation.decode.DecodePreallocQueue", "token_to_kv_pool"),
)
def queue_kv_pool(queue: Any) -> Any:
    return queue.token_to_kv_pool


@relies(
    attribute("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool", "k_buffer"),
    attribute("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool", "v_buffer"),
    attribute("sglang.srt.mem_cache.memory_pool.KVCache", "dtype"),
    attribute("sglang.srt.mem_cache.memory_pool.KVCache", "store_dtype"),
)
def kv_pool_buffers(pool: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer K and V buffers of an MHA KV pool; raises (naming the pool) for any
    other kind, and for a quantized KV cache."""
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if not isinstance(k, list) or not isinstance(v, list):
        raise LynxConfigError(f"--lynx needs an MHA KV pool with per-layer K/V buffers, got {type(pool)}")
    if getattr(pool, "store_dtype", pool.dtype) != pool.dtype:
        raise LynxConfigError(f"--lynx does not support a quantized KV cache ({pool.dtype})")
    return k, v


@relies(
    method("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator", "available_size"),
    attribute(SCHEDULER, "token_to_kv_pool_allocator"),
)
def free_kv_tokens(scheduler: Any) -> int:
    return int(scheduler.token_to_kv_pool_allocator.available_size())


@relies(
    attribute(BATCH, "forward_mode"),
    attribute(BATCH, "reqs"),
    method("sglang.srt.model_executor.forward_batch_info.ForwardMode", "is_extend"),
    attribute(REQ, "pending_bootstrap"),
    attribute(REQ, "start_send_idx"),
    attribute(REQ, "extend_end"),
    attribute(REQ, "origin_input_ids"),
    attribute(REQ, "bootstrap_room"),
    attribute(REQ, "kv"),
    attribute(f"{SCHEDULE_BATCH}.ReqKvInfo", "req_pool_idx"),
    attribute(SCHEDULER, "req_to_token_pool"),
    attribute(SCHEDULER, "token_to_kv_pool_allocator"),
    attribute("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "req_to_token"),
    method(
        "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator",
        "translate_kv_indices_for_transfer",
        "kv_indices",
    ),
    attribute("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator", "page_size"),
    Relied("sglang.srt.mem_cache.common", "kv_to_page_indices", "function"),
)
def chunks_to_send(scheduler: Any, batch: Any) -> list[tuple[int, np.ndarray]]:
    """(room, prefill pages) of each PD request of a prefill batch about to run whose chunk
    will be sent once it is computed: the pages upstream's ``_send_kv_chunk`` will hand the
    KV sender after the forward (from ``start_send_idx`` to the chunk's end, a partial last
    page held back unless the prompt ends there), computed the same way."""
    from sglang.srt.mem_cache.common import kv_to_page_indices

    if not batch.forward_mode.is_extend():
        return []
    allocator = scheduler.token_to_kv_pool_allocator
    page_size = allocator.page_size
    chunks = []
    for req in batch.reqs:
        if req.bootstrap_room is None or req.pending_bootstrap or req.extend_end is None:
            continue
        prompt = len(req.origin_input_ids)
        end = min(req.extend_end, prompt)
        if end < prompt:
            end -= end % page_size
        if end <= req.start_send_idx:
            continue
        kv = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, req.start_send_idx : end]
        pages = kv_to_page_indices(allocator.translate_kv_indices_for_transfer(kv), page_size)
        chunks.append((int(req.bootstrap_room), pages))
    return chunks


@relies(attribute("sglang.srt.mem_cache.memory_pool.KVCache", "start_layer"))
def kv_pool_start_layer(pool: Any) -> int:
    """The model layer of a KV pool's first layer."""
    return int(pool.start_layer)


@relies(
    attribute("sglang.srt.layers.radix_attention.RadixAttention", "layer_id"),
    attribute("sglang.srt.model_executor.forward_batch_info.ForwardBatch", "forward_mode"),
    method("sglang.srt.model_executor.forward_batch_info.ForwardMode", "is_extend"),
)
def extended_layer(attention: Any, forward_batch: Any) -> int | None:
    """The model layer an attention layer is, in an extend (prefill) forward, where it has
    just written its KV; None in any other forward."""
    if not forward_batch.forward_mode.is_extend():
        return None
    return int(attention.layer_id)


@relies(
    attribute(f"{_DECODE}.DecodePreallocQueue", "scheduler"),
    attribute(SCHEDULER, "server_args"),
    attribute("sglang.srt.server_args.ServerArgs", "disaggregation_decode_enable_radix_cache"),
)
def decode_radix_cache(queue: Any) -> bool:
    """Whether the decode server of ``queue`` keeps a radix cache of received prompts."""
    return bool(queue.scheduler.server_args.disaggregation_decode_enable_radix_cache)


@relies(
    attribute("sglang.srt.configs.model_config.ModelConfig", "vocab_size"),
    attribute(SCHEDULER, "model_config"),
)
def vocab_size(scheduler: Any) -> int:
    return int(scheduler.model_config.vocab_size)


@relies(
    method(BATCH, "filter_batch", "keep_indices"),
    attribute(SCHEDULER, "running_batch"),
    attribute(SCHEDULER, "waiting_queue"),
    attribute(BATCH, "reqs"),
)
def remove_from_batches(scheduler: Any, reqs: Iterable[Any]) -> None:
    """Take ``reqs`` out of the running batch and the waiting queue (they keep their KV)."""
    ids = {id(req) for req in reqs}
    batch = scheduler.running_batch
    if any(id(req) in ids for req in batch.reqs):
        batch.filter_batch(keep_indices=[i for i, req in enumerate(batch.reqs) if id(req) not in ids])
    if any(id(req) in ids for req in scheduler.waiting_queue):
        scheduler.waiting_queue = [req for req in scheduler.waiting_queue if id(req) not in ids]


@relies(attribute(SCHEDULER, "enable_overlap"))
def overlaps(scheduler: Any) -> bool:
    """The scheduler runs upstream's overlap loop (a batch in flight while the last one's
    results are processed)."""
    return bool(scheduler.enable_overlap)


@relies(
    method(SCHEDULER, "process_batch_result", "batch", "result"),
    attribute(SCHEDULER, "enable_overlap"),
    attribute(SCHEDULER, "last_batch"),
    attribute(SCHEDULER, "result_queue"),
)
def process_in_flight_batch(scheduler: Any) -> None:
    """Overlap loop: process the results of the batch launched last iteration now, so no
    request has a token in flight, and leave the loop no last batch to process -- what
    upstream's own ``pause_generation`` does before it retracts. A no-op otherwise."""
    if scheduler.enable_overlap and scheduler.last_batch is not None and scheduler.result_queue:
        batch, result = scheduler.result_queue.popleft()
        scheduler.process_batch_result(batch, result)
        scheduler.last_batch = None


@relies(attribute("sglang.srt.managers.io_struct.PauseGenerationReqInput", "mode"))
def pause_retracts(recv_req: Any) -> bool:
    """A ``pause_generation`` request that retracts running requests (not in place)."""
    return recv_req.mode == "retract"


@relies(attribute(SCHEDULER, "waiting_queue"))
def requeue(scheduler: Any, req: Any) -> None:
    """Back through the waiting queue: upstream's prebuilt path re-admits it with its
    committed tokens, as it resumes a retracted request."""
    scheduler.waiting_queue.append(req)


@relies(
    attribute(SCHEDULER, "tree_cache"),
    Relied("sglang.srt.mem_cache.common", "release_kv_cache", "function"),
)
def release_and_answer(scheduler: Any, req: Any) -> None:
    """A finished request: free its KV and answer the client (upstream's prebuilt path
    refuses finished requests)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    release_kv_cache(req, scheduler.tree_cache, checkpoint=True)
    stream_now(scheduler, req)


@relies(
    attribute(REQ, "return_logprob"),
    attribute(SCHEDULER, "output_streamer"),
    method(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer",
        "stream_output",
        "reqs",
        "return_logprob",
    ),
)
def stream_now(scheduler: Any, req: Any) -> None:
    """Stream what ``req`` has not streamed yet, now, through upstream's output streamer:
    a finished request's answer, or the first token of one still in the waiting queue
    (upstream's prebuilt path streams it when a transferred request joins a batch)."""
    scheduler.output_streamer.stream_output([req], req.return_logprob)


@relies(method(BATCH, "filter_batch", "keep_indices"), attribute(BATCH, "reqs"))
def batch_without(batch: Any, remove: Sequence[int]) -> None:
    """Drop rows ``remove`` of ``batch`` (their requests keep their KV)."""
    gone = set(remove)
    batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i not in gone])


@relies(
    method(
        "sglang.srt.managers.scheduler_components.new_token_ratio_tracker.NewTokenRatioTracker",
        "estimate_new_token_ratio_after_retract",
    ),
)
def nothing_retracted(parked: list[Any]) -> tuple[list[Any], float, list[Any]]:
    """``retract_decode``'s result when Lynx parked every request of the batch instead."""
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

    return [], NewTokenRatioTracker.estimate_new_token_ratio_after_retract(parked), []
