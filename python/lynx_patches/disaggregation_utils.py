"""Swap Lynx's Mooncake connector classes in when ``--lynx`` is on.

Hook targets (``sglang.srt.`` omitted):
* ``disaggregation.utils.get_kv_class`` AROUND: for the Mooncake backend, return
  :mod:`lynx_patches.mooncake_connector`'s ``LynxKVManager``/``LynxKVSender``/``LynxKVReceiver``
  instead of upstream's manager, sender and receiver. Every other class (KV args,
  bootstrap server, other backends, the fake backend used for warm-up) is upstream's.
"""

from __future__ import annotations

from typing import Any

from lynx import settings
from lynx_patches._hooks import hook

TARGET = "disaggregation.utils.get_kv_class"


def _lynx_classes(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    cls = original(transfer_backend, class_type)
    if settings.current() is None:
        return cls
    from lynx_patches import mooncake_connector  # imports SGLang's Mooncake connector

    return mooncake_connector.LYNX_CLASSES.get(cls, cls)


def register() -> None:
    hook(TARGET, _lynx_classes, "around")
