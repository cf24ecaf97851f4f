"""The decode side of PD disaggregation: Lynx's receiver meets the KV pool and the request.

Hook targets (``sglang.srt.`` omitted):
* ``disaggregation.decode.DecodePreallocQueue._init_kv_manager`` AROUND: after upstream
  built the KV manager (a ``LynxKVManager`` with ``--lynx``), hand it the KV pool, whose
  buffers Lynx decodes into and whose size sizes the receive buffer.
* ``disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req`` AROUND: upstream
  drops the receiver there; keep its Lynx transfer report on the request
  (``customized_info["lynx_transfer"]``, which the response's ``meta_info`` carries), and
  in speculative mode hand a request whose Residual is still in flight to the
  :class:`~lynx_patches.lynx_speculation.SpeculativeDecoder`.
* ``disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue``
  AFTER (speculative mode): poll the Residuals, verify, commit, roll back
  (:meth:`~lynx_patches.lynx_speculation.SpeculativeDecoder.step`). Upstream's loop is
  quiescent there: the previous batch's results are processed, the next is not built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lynx_patches import lynx_speculation
from lynx_patches._hooks import hook

INIT_KV_MANAGER = "disaggregation.decode.DecodePreallocQueue._init_kv_manager"
COMMIT = "disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
PROCESS_DECODE_QUEUE = "disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue"


def attach_pool(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    manager = original(queue, *args, **kwargs)
    attach = getattr(manager, "lynx_attach_pool", None)
    if attach is not None:
        attach(queue.token_to_kv_pool)
    return manager


def _keep_report(original: Any, queue: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
    receiver = decode_req.kv_receiver
    result = original(queue, decode_req, *args, **kwargs)
    req = decode_req.req
    speculating = getattr(receiver, "lynx_speculating", False)
    decoder = lynx_speculation.current()
    if speculating and decoder is not None and not req.finished():
        vocab_size = queue.scheduler.model_config.vocab_size
        decoder.admit(req, receiver.bootstrap_room, receiver.lynx_slots, vocab_size)
        return result
    if speculating:  # finished on its first token: nothing to speculate on
        receiver.lynx_end_speculation()
    report = getattr(receiver, "lynx_report", None)
    if report is not None:
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[lynx_speculation.META_INFO_KEY] = [dataclasses.asdict(report)]
    return result


def _speculate(result: Any, scheduler: Any, *_args: Any, **_kwargs: Any) -> Any:
    decoder = lynx_speculation.current()
    if decoder is not None:
        decoder.step(scheduler)
    return result


def register() -> None:
    hook(INIT_KV_MANAGER, attach_pool, "around")
    hook(COMMIT, _keep_report, "around")
    hook(PROCESS_DECODE_QUEUE, _speculate, "after")
