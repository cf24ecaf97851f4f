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
  is still in flight to the :class:`~lynx.speculative.SpeculativeDecoder`.
* ``disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue``
  AFTER (speculative mode): poll the Residuals, verify, commit, roll back
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
    result = original(queue, decode_req, *args, **kwargs)
    req = decode_req.req
    if not isinstance(receiver, runtime.LynxReceiverRole):  # upstream's receiver: no Lynx
        return result
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


def _speculate(result: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> Any:
    decoder = runtime.speculative_decoder()
    if decoder is not None:
        decoder.step(scheduler, upstream.rank_reduce_min(scheduler))
    return result


def register() -> None:
    hook(INIT_KV_MANAGER, runtime.build_on_kv_manager, "around")
    hook(SEND_KV_METADATA, _receive_only_what_is_read, "around")
    hook(COMMIT, _keep_report, "around")
    hook(PROCESS_DECODE_QUEUE, _speculate, "after")
