"""The decode side of PD disaggregation: Lynx's receiver meets the KV pool and the request.

Hook targets (``sglang.srt.`` omitted):
* ``disaggregation.decode.DecodePreallocQueue._init_kv_manager`` AROUND: after upstream
  built the KV manager (a ``LynxKVManager`` with ``--lynx``), hand it the KV pool, whose
  buffers Lynx decodes into and whose size sizes the receive buffer.
* ``disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req`` AROUND: upstream
  drops the receiver there; keep its Lynx transfer report on the request
  (``customized_info["lynx_transfer"]``), which the response's ``meta_info`` carries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lynx_patches._hooks import hook

INIT_KV_MANAGER = "disaggregation.decode.DecodePreallocQueue._init_kv_manager"
COMMIT = "disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
META_INFO_KEY = "lynx_transfer"


def attach_pool(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    manager = original(queue, *args, **kwargs)
    attach = getattr(manager, "lynx_attach_pool", None)
    if attach is not None:
        attach(queue.token_to_kv_pool)
    return manager


def _keep_report(original: Any, queue: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
    receiver = decode_req.kv_receiver
    result = original(queue, decode_req, *args, **kwargs)
    report = getattr(receiver, "lynx_report", None)
    if report is not None:
        req = decode_req.req
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[META_INFO_KEY] = [dataclasses.asdict(report)]
    return result


def register() -> None:
    hook(INIT_KV_MANAGER, attach_pool, "around")
    hook(COMMIT, _keep_report, "around")
