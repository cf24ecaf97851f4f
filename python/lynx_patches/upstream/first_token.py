"""Decode's transfer queue, as the early first token reaches it: which requests wait there,
whether prefill's aux data (their first token) has landed in their metadata row, and
upstream's own commit of it ahead of the KV."""

from __future__ import annotations

from typing import Any

from lynx_patches.upstream.contract import REQ, SCHEDULER, Relied, attribute, method, relies

_DECODE = "sglang.srt.disaggregation.decode"
_TRANSFER_QUEUE = f"{_DECODE}.DecodeTransferQueue"
_DECODE_REQUEST = f"{_DECODE}.DecodeRequest"
_RECEIVER = "sglang.srt.disaggregation.base.conn.BaseKVReceiver"
_TIME_STATS = "sglang.srt.observability.req_time_stats.SchedulerReqTimeStats"

RELIED: tuple[Relied, ...] = ()  # every name is declared by the accessor that touches it


@relies(attribute(SCHEDULER, "disagg_decode_transfer_queue"), attribute(_TRANSFER_QUEUE, "queue"))
def transfer_queue(scheduler: Any) -> tuple[Any, list[Any]]:
    """Decode's transfer queue and its entries (``DecodeRequest``s, the same on every TP
    rank, in the same order)."""
    queue = scheduler.disagg_decode_transfer_queue
    return queue, list(queue.queue)


@relies(
    attribute(_TRANSFER_QUEUE, "scheduler"),
    attribute(_TRANSFER_QUEUE, "enable_staging"),
    attribute(SCHEDULER, "enable_decode_hicache"),
    attribute(_DECODE_REQUEST, "req"),
    attribute(_DECODE_REQUEST, "is_rebootstrap"),
    attribute(_DECODE_REQUEST, "host_staged"),
    attribute(REQ, "output_ids"),
    attribute(REQ, "send_token_offset"),
    attribute(REQ, "grammar"),
    attribute(REQ, "return_sampling_mask"),
)
def first_token_may_go_early(queue: Any, decode_req: Any) -> bool:
    """Whether upstream's commit of the request's first token may run ahead of its KV:
    a fresh request (nothing in its output, nothing streamed, not rebootstrapped after a
    retraction), received into device pages (no staging buffer, no host staging, no
    decode HiCache restore: their commits do more than take the token), and without a
    grammar or a sampling mask (which feed the first token to decode-side state)."""
    req = decode_req.req
    return (
        not req.output_ids
        and req.send_token_offset == 0
        and not decode_req.is_rebootstrap
        and not decode_req.host_staged
        and not queue.enable_staging
        and not queue.scheduler.enable_decode_hicache
        and req.grammar is None
        and not req.return_sampling_mask
    )


@relies(
    attribute(_TRANSFER_QUEUE, "metadata_buffers"),
    attribute(_DECODE_REQUEST, "metadata_buffer_index"),
    attribute("sglang.srt.disaggregation.utils.MetadataBuffers", "bootstrap_room"),
)
def aux_row_landed(queue: Any, decode_req: Any) -> bool:
    """The request's metadata row holds prefill's aux data (upstream's metadata gate, which
    holds its own commit until the row's room is written)."""
    row = queue.metadata_buffers.bootstrap_room[decode_req.metadata_buffer_index, 0]
    return int(row.item()) != 0


class _KeptReceiver:
    """Stands in for a request's receiver while upstream commits its first token early:
    upstream clears and drops the receiver it commits; this one is the one cleared."""

    def clear(self) -> None:
        pass


@relies(
    method(_TRANSFER_QUEUE, "_commit_transfer_to_req", "decode_req"),
    attribute(_DECODE_REQUEST, "kv_receiver"),
)
def commit_first_token(queue: Any, decode_req: Any) -> None:
    """Upstream's commit of the transfer (the first token, its logprobs, the cached-token
    counts) into the request, run while its receiver goes on receiving its KV: every field
    as plain PD sets it, by upstream's own code. The receiver is kept for the later commit
    (:func:`end_commit`)."""
    receiver = decode_req.kv_receiver
    decode_req.kv_receiver = _KeptReceiver()
    try:
        queue._commit_transfer_to_req(decode_req)
    finally:
        decode_req.kv_receiver = receiver


@relies(
    attribute(_DECODE_REQUEST, "kv_receiver"),
    attribute(_DECODE_REQUEST, "req"),
    method(_RECEIVER, "clear"),
    attribute(REQ, "time_stats"),
    method(_TIME_STATS, "set_wait_queue_entry_time"),
)
def end_commit(decode_req: Any) -> None:
    """What upstream's commit does last, for a request whose first token
    :func:`commit_first_token` committed already: clear and drop the receiver, and start
    the request's wait for a batch."""
    decode_req.kv_receiver.clear()
    decode_req.kv_receiver = None
    decode_req.req.time_stats.set_wait_queue_entry_time()
