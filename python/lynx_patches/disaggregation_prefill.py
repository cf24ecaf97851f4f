"""The prefill side of PD disaggregation: Lynx's sender meets the KV pool; a CPU guard.

Hook targets (``sglang.srt.`` omitted):
* ``disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager`` AROUND: after upstream
  built the KV manager (a ``LynxKVManager`` with ``--lynx``), build this process's Lynx
  runtime on the KV pool it encodes from (:func:`lynx_patches.runtime.build_on_kv_manager`).
* ``disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk``
  AROUND (CPU engine only): under the overlap scheduler this optional early send of a cached prefix
  records a ``torch.cuda.Event`` to order the send after the previous forward; there is
  no CUDA on the CPU engine, so the prefix is sent with the final chunk instead (which
  upstream documents as always covering it).
"""

from __future__ import annotations

from typing import Any

from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook, is_cpu_engine

INIT_KV_MANAGER = "disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager"
EARLY_PREFIX_SEND = (
    "disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk"
)


def _skip_early_send_under_overlap(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    if upstream.overlaps(scheduler):
        return None
    return original(scheduler, *args, **kwargs)


def register() -> None:
    hook(INIT_KV_MANAGER, runtime.build_on_kv_manager, "around")
    if is_cpu_engine():
        hook(EARLY_PREFIX_SEND, _skip_early_send_under_overlap, "around")
