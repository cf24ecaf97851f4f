"""CPU-engine guard on the prefill side of PD disaggregation.

Hook targets (``sglang.srt.`` omitted; registered on the CPU engine only):
* ``disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk``
  AROUND: under the overlap scheduler this optional early send of a cached prefix
  records a ``torch.cuda.Event`` to order the send after the previous forward; there is
  no CUDA on the CPU engine, so the prefix is sent with the final chunk instead (which
  upstream documents as always covering it).
"""

from __future__ import annotations

from typing import Any

from lynx_patches._hooks import hook

TARGET = "disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk"


def _skip_early_send_under_overlap(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    if scheduler.enable_overlap:
        return None
    return original(scheduler, *args, **kwargs)


def register() -> None:
    hook(TARGET, _skip_early_send_under_overlap, "around")
