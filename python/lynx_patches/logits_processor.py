"""Logits at every position of Lynx's verify forward (``--lynx-mode speculative``).

Hook target (``sglang.srt.`` omitted):
* ``layers.logits_processor.LogitsMetadata.from_forward_batch`` AROUND (a classmethod):
  while Lynx runs its verify extend (``lynx_speculation.verify_pass``), mark the metadata
  TARGET_VERIFY, for which upstream's logits processor keeps every row instead of only
  each request's last one. Every other forward is untouched.
"""

from __future__ import annotations

from typing import Any

from lynx_patches import lynx_speculation
from lynx_patches._hooks import hook

TARGET = "layers.logits_processor.LogitsMetadata.from_forward_batch"


def _all_positions_while_verifying(
    original: Any, cls: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    metadata = original(cls, forward_batch, *args, **kwargs)
    if getattr(lynx_speculation.verify_pass, "active", False):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        metadata.forward_mode = ForwardMode.TARGET_VERIFY
    return metadata


def register() -> None:
    hook(TARGET, _all_positions_while_verifying, "around")
