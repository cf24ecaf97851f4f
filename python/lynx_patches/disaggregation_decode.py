"""Bind Lynx's receiver to the decode server's KV pool.

Hook targets (``sglang.srt.`` omitted):
* ``disaggregation.decode.DecodePreallocQueue._init_kv_manager`` AROUND: after upstream
  built the KV manager (a ``LynxKVManager`` with ``--lynx``), hand it the KV pool, whose
  buffers Lynx decodes into and whose size sizes the receive buffer.
"""

from __future__ import annotations

from typing import Any

from lynx_patches._hooks import hook

TARGET = "disaggregation.decode.DecodePreallocQueue._init_kv_manager"


def attach_pool(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    manager = original(queue, *args, **kwargs)
    attach = getattr(manager, "lynx_attach_pool", None)
    if attach is not None:
        attach(queue.token_to_kv_pool)
    return manager


def register() -> None:
    hook(TARGET, attach_pool, "around")
