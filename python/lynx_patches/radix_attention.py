"""Each attention layer's KV written in a prefill forward: the point where its Anchor can
leave (``--lynx-layerwise-from``).

Hook target (``sglang.srt.`` omitted):
* ``layers.radix_attention.RadixAttention.forward`` AFTER: in an extend forward the layer
  has written its KV for the batch's new tokens into the pool (the attention backends
  write before they attend); tell the sender
  (:meth:`lynx.transfer.ProgressiveSender.layer_done`), which encodes and sends that
  layer's Anchor of each chunk announced before the forward (:mod:`lynx_patches.scheduler`).

Contract: the thread that runs the forward, once per layer per forward; registered only
on servers started with ``--lynx-layerwise-from`` above 0, and a no-op on any but a Lynx
prefill server. It never raises into the forward: a Lynx bug here logs and stops
streaming on this server (each chunk's Anchor then leaves once the chunk is computed).
"""

from __future__ import annotations

import logging
from typing import Any

from lynx import settings
from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

logger = logging.getLogger(__name__)

TARGET = "layers.radix_attention.RadixAttention.forward"


_failed = False  # a Lynx bug here stopped streaming on this server


def _layer_written(result: Any, attention: Any, *args: Any, **kwargs: Any) -> Any:
    global _failed
    lynx = runtime.current()
    sender = None if lynx is None else lynx.sender
    if sender is None or _failed:
        return result
    try:
        forward_batch = kwargs["forward_batch"] if "forward_batch" in kwargs else args[3]
        layer = upstream.extended_layer(attention, forward_batch)
        if layer is not None:
            sender.layer_done(layer - lynx.kv_start_layer)
    except Exception:
        _failed = True
        logger.exception("Lynx: sending Anchors layer by layer failed; each chunk's leaves once computed")
    return result


def register() -> None:
    if settings.layerwise():
        hook(TARGET, _layer_written, "after")
