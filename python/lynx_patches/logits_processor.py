"""Logits at every position of Lynx's verify forward (``--lynx-mode speculative``).

Hook target (``sglang.srt.`` omitted):
* ``layers.logits_processor.LogitsMetadata.from_forward_batch`` AROUND (a classmethod):
  while Lynx runs its verify extend (:func:`lynx_patches.upstream.run_verify_forward`),
  mark the metadata TARGET_VERIFY, for which upstream's logits processor keeps every row
  instead of only each request's last one. Every other forward is untouched.

Contract: the model's thread (the scheduler's, without overlap); a no-op outside the
verify pass.
"""

from __future__ import annotations

from typing import Any

from lynx_patches import upstream
from lynx_patches._hooks import hook

TARGET = "layers.logits_processor.LogitsMetadata.from_forward_batch"


def _all_positions_while_verifying(
    original: Any, cls: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    metadata = original(cls, forward_batch, *args, **kwargs)
    if upstream.verify_pass_active():
        upstream.keep_all_positions(metadata)
    return metadata


def register() -> None:
    hook(TARGET, _all_positions_while_verifying, "around")
