"""Lynx's per-request transfer report in the response's ``meta_info``.

Hook targets (``sglang.srt.`` omitted):
* ``managers.scheduler_components.output_streamer.SchedulerOutputStreamer``
  ``.is_request_level_customized_info_key`` AROUND: ``lynx_transfer`` is one value per
  request, not one per token.
"""

from __future__ import annotations

from typing import Any

from lynx_patches._hooks import hook
from lynx_patches.disaggregation_decode import META_INFO_KEY

TARGET = (
    "managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
    ".is_request_level_customized_info_key"
)


def _lynx_key_is_per_request(original: Any, streamer: Any, key: str) -> bool:
    return key == META_INFO_KEY or original(streamer, key)


def register() -> None:
    hook(TARGET, _lynx_key_is_per_request, "around")
