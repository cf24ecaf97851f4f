"""The decode side of PD disaggregation: Lynx's receiver meets the KV pool and the request.

Hook targets (``sglang.srt.`` omitted):
* ``disaggregation.decode.DecodePreallocQueue._init_kv_manager`` AROUND: after upstream
  built the KV manager (a ``LynxKVManager`` with ``--lynx``), build this process's Lynx
  runtime on the KV pool (:func:`lynx_patches.runtime.build_on_kv_manager`).
* ``disaggregation.decode.DecodePreallocQueue._send_kv_metadata`` AROUND: a request that
  will never read its prompt's KV here (no new tokens, no radix cache to keep it:
  :func:`lynx.transfer.parallel_samples.decode_reads_prompt_kv`) asks prefill for none of
  it, as if decode held the whole prompt (``decode_prefix_len``).
* ``disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req`` AROUND: upstream
  drops the receiver there; keep its Lynx transfer report on the request (the response's
  ``meta_info["lynx_transfer"]``), and in speculative mode hand a request whose Residual
  is still in flight to the :class:`~lynx.speculative.SpeculativeDecoder`. A request
  whose first token was committed early (below) gets only the commit's last step
  (``upstream.end_commit``): the token is in already.
* ``disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue``
  AFTER: (every mode) **the first token early**: a request in the transfer queue whose
  aux data (prefill's first token and its logprobs) has landed while Lynx's KV is still
  on the way gets upstream's own commit of it (``upstream.commit_first_token``, its
  receiver kept) and upstream's streamer sends it now, exactly the chunk plain PD sends
  later; every TP rank does it alike (MIN over the ranks' "my row landed"). Requests
  with a grammar, a sampling mask, staged or HiCache-restored KV, or rebootstrapped
  keep upstream's timing (``upstream.first_token_may_go_early``), as do those that end
  at their first token (upstream answers a request from the batch it joins, unfinished). Then (speculative
  mode) poll the Residuals, verify, commit, roll back
  (:meth:`~lynx.speculative.SpeculativeDecoder.step`), agreeing with the
  other TP ranks first. Upstream's loop is quiescent there: the previous batch's results
  are processed, the next is not built; every rank runs it once per iteration.

Contract: scheduler thread. ``_send_kv_metadata`` once per request given KV pages;
``_commit_transfer_to_req`` once per request whose transfer upstream concluded;
``process_decode_queue`` once per iteration. Without ``--lynx`` each
calls the original unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lynx.speculative import META_INFO_KEY
from lynx.transfer.parallel_samples import decode_reads_prompt_kv
from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

INIT_KV_MANAGER = "disaggregation.decode.DecodePreallocQueue._init_kv_manager"
SEND_KV_METADATA = "disaggregation.decode.DecodePreallocQueue._send_kv_metadata"
COMMIT = "disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
PROCESS_DECODE_QUEUE = "disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue"


def _receive_only_what_is_read(
    original: Any, queue: Any, decode_req: Any, kv_indices: Any, page_size: int, *args: Any, **kwargs: Any
) -> Any:
    if runtime.current() is not None and not decode_reads_prompt_kv(
        upstream.max_new_tokens(decode_req.req), upstream.decode_radix_cache(queue)
    ):
        # kv_indices are the slots of the tokens past decode's prefix: claim those too.
        kwargs["decode_prefix_len"] = kwargs.get("decode_prefix_len", 0) + len(kv_indices)
        kv_indices = kv_indices[:0]
    return original(queue, decode_req, kv_indices, page_size, *args, **kwargs)


def _keep_report(original: Any, queue: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
    receiver = decode_req.kv_receiver
    if not isinstance(receiver, runtime.LynxReceiverRole):  # upstream's receiver: no Lynx
        return original(queue, decode_req, *args, **kwargs)
    result = None
    if receiver.lynx_first_token_committed:  # upstream committed the first token already
        upstream.end_commit(decode_req)
    else:
        result = original(queue, decode_req, *args, **kwargs)
    req = decode_req.req
    speculating = receiver.lynx_speculating
    decoder = runtime.speculative_decoder()
    if speculating and decoder is not None and not req.finished():
        assert receiver.lynx_slots is not None
        decoder.admit(
            req,
            receiver.bootstrap_room,
            receiver.lynx_slots,
            upstream.vocab_size(upstream.queue_scheduler(queue)),
        )
        return result
    if speculating:  # finished on its first token: nothing to speculate on
        receiver.lynx_end_speculation()
    if receiver.lynx_report is not None:
        upstream.set_request_info(req, META_INFO_KEY, dataclasses.asdict(receiver.lynx_report))
    return result


def _after_polling(result: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> Any:
    lynx = runtime.current()
    if lynx is not None and lynx.receiver is not None:
        _stream_first_tokens(lynx, scheduler)
        if lynx.decoder is not None:
            lynx.decoder.step(scheduler, upstream.rank_reduce_min(scheduler))
    return result


def _stream_first_tokens(lynx: runtime.LynxRuntime, scheduler: Any) -> None:
    """Commit and stream the first token of each request whose aux data (prefill's first
    token, with its logprobs) has landed while its KV is still on the way: upstream's own
    commit of it, then upstream's streamer; the client sees it now, not once the KV has
    landed. Every TP rank commits it alike, once every rank has the row."""
    queue, entries = upstream.transfer_queue(scheduler)
    waiting = [
        decode_req
        for decode_req in entries
        if isinstance(decode_req.kv_receiver, runtime.LynxReceiverRole)
        and not decode_req.kv_receiver.lynx_first_token_committed
        and upstream.first_token_may_go_early(queue, decode_req)
    ]
    if not waiting:
        return
    landed = [
        int(decode_req.kv_receiver.lynx_aux_landed and upstream.aux_row_landed(queue, decode_req))
        for decode_req in waiting
    ]
    for decode_req, agreed in zip(waiting, upstream.rank_reduce_min(scheduler)(landed), strict=True):
        if not agreed:
            continue
        receiver, req = decode_req.kv_receiver, decode_req.req
        upstream.commit_first_token(queue, decode_req)
        receiver.lynx_first_token_committed = True
        if upstream.is_finished(req) or upstream.is_aborting(req):
            continue  # upstream's commit or the client ended it: answered at upstream's timing
        upstream.update_finish_state(req, 1)
        if upstream.is_finished(req):
            # It ends at its first token: upstream answers it from the batch it joins once
            # its KV has landed (a request joins one unfinished), as without Lynx.
            upstream.clear_finish(req)
            continue
        upstream.stream_now(scheduler, req)
        if not upstream.first_stream_chunk(req):
            lynx.streamed_ahead.add(req)  # its prebuilt step would stream nothing new


def register() -> None:
    hook(INIT_KV_MANAGER, runtime.build_on_kv_manager, "around")
    hook(SEND_KV_METADATA, _receive_only_what_is_read, "around")
    hook(COMMIT, _keep_report, "around")
    hook(PROCESS_DECODE_QUEUE, _after_polling, "after")
