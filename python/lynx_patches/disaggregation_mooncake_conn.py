"""CPU-engine guard on SGLang's Mooncake KV sender.

Hook targets (``sglang.srt.`` omitted; registered on the CPU engine only):
* ``disaggregation.mooncake.conn.MooncakeKVSender.__init__`` AFTER: clear
  ``supports_host_tensor_indices`` on the instance.  With it set, the prefill send path
  (``disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk``) copies
  page indices into pinned memory and records a ``torch.cuda.Event`` so the transfer
  worker can wait for the copy; neither exists on the CPU engine, where the indices are
  already host tensors and the plain path is exact.
"""

from __future__ import annotations

from typing import Any

from lynx_patches._hooks import hook

TARGET = "disaggregation.mooncake.conn.MooncakeKVSender.__init__"


def _host_indices_without_events(_result: None, sender: Any, *_args: Any, **_kwargs: Any) -> None:
    sender.supports_host_tensor_indices = False


def register() -> None:
    hook(TARGET, _host_indices_without_events, "after")
