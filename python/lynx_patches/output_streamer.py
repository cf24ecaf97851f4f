"""What Lynx changes in the scheduler's output streaming.

Hook targets (``sglang.srt.`` omitted):
* ``managers.scheduler_components.output_streamer.SchedulerOutputStreamer``
  ``.is_request_level_customized_info_key`` AROUND: ``lynx_transfer`` is one value per
  request, not one per token.
* ``managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept``
  AROUND: a streamed request sends ``lynx_transfer`` again with its last chunk, so a
  streaming client gets the final report (Residual bytes, speculation) as
  ``meta_info["lynx_transfer"][-1]``; upstream sends such info with the first chunk only,
  when the Residual may not have landed yet.
* ``managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output``
  AROUND: a request whose first token streamed before it joined a batch (as soon as
  prefill's aux data landed, ahead of its KV: :mod:`lynx_patches.disaggregation_decode`;
  or while it waited for its Residual out of every batch) is left out of the prebuilt
  step that takes it into a batch while it has no new token (that chunk would repeat the
  first one, empty). In ``--lynx-mode speculative`` requests holding unverified tokens
  are left out, so neither their tokens nor their stream offsets move; verification may
  still cut them. The first token (prefill's, exact) passes; a finished request always
  passes.

Contract: scheduler thread, any number of times per iteration; without a speculative
decoder and with no request whose first token streamed ahead, upstream's call is
unchanged.
"""

from __future__ import annotations

from typing import Any

from lynx.speculative import META_INFO_KEY
from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

STREAMER = "managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
ACCUMULATOR = "managers.scheduler_components.output_streamer._GenerationStreamAccumulator"


def _lynx_key_is_per_request(original: Any, streamer: Any, key: str) -> bool:
    return key == META_INFO_KEY or original(streamer, key)


def _final_report_at_stream_end(original: Any, accumulator: Any, *args: Any, **kwargs: Any) -> Any:
    req = kwargs["req"] if "req" in kwargs else args[0]
    first = upstream.first_stream_chunk(req)
    result = original(accumulator, *args, **kwargs)
    if not first:  # a first chunk carries the report already
        upstream.resend_request_info(accumulator, req, META_INFO_KEY)
    return result


def _hold_back(original: Any, streamer: Any, reqs: list[Any], *args: Any, **kwargs: Any) -> Any:
    lynx = runtime.current()
    if lynx is None or (lynx.decoder is None and not lynx.streamed_ahead):
        return original(streamer, reqs, *args, **kwargs)
    released = [req for req in reqs if _streams(lynx, req)]
    if len(released) == len(reqs):
        return original(streamer, reqs, *args, **kwargs)
    if not released:
        return None
    return original(streamer, released, *args, **kwargs)


def _streams(lynx: runtime.LynxRuntime, req: Any) -> bool:
    """``req`` is to be in the output batch being streamed now: it holds no unverified
    token, and is not a request whose first token streamed ahead with nothing new since."""
    if lynx.streamed_ahead.take(req):
        return not upstream.streamed_every_token(req)
    return lynx.decoder is None or not lynx.decoder.speculations.holds_tokens(req)


def register() -> None:
    hook(STREAMER + ".is_request_level_customized_info_key", _lynx_key_is_per_request, "around")
    hook(STREAMER + ".stream_output", _hold_back, "around")
    hook(ACCUMULATOR + ".accept", _final_report_at_stream_end, "around")
