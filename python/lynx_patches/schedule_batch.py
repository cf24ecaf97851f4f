"""Speculative requests in SGLang's batch bookkeeping (``--lynx-mode speculative``).

Hook targets (``sglang.srt.`` omitted):
* ``managers.schedule_batch.Req.update_finish_state`` AROUND: upstream calls it after each
  decode step appended a token. For a request decoding on Anchor KV, record the token as
  held (parking the request at the cap) and defer a finish it would cause (EOS, stop
  string, max_new_tokens): held tokens only count once verified. An abort passes
  through, with the output cut back to what was committed so no held token reaches the
  client.
* ``managers.schedule_batch.ScheduleBatch.retract_decode`` AROUND: under KV memory
  pressure, park the speculative requests (they stop growing and keep their KV until
  their Residual lands) before upstream retracts anything.
"""

from __future__ import annotations

from typing import Any

from lynx.verify import ParkReason
from lynx_patches import lynx_speculation
from lynx_patches._hooks import hook

UPDATE_FINISH_STATE = "managers.schedule_batch.Req.update_finish_state"
RETRACT_DECODE = "managers.schedule_batch.ScheduleBatch.retract_decode"


def _hold_or_defer(original: Any, req: Any, new_accepted_len: int = 1) -> Any:
    if not lynx_speculation.is_speculating(req):
        return original(req, new_accepted_len)
    spec = lynx_speculation.speculation_of(req)
    assert spec is not None
    if req.to_finish is not None:  # an abort: the client sees only committed tokens
        del req.output_ids[1:]
        return original(req, new_accepted_len)
    new = list(req.output_ids[1 + len(spec.held.tokens) :])
    if not new:  # the first token, from prefill: exact, its finish counts
        return original(req, new_accepted_len)
    if len(new) != 1:
        raise RuntimeError(f"request {req.rid}: {len(new)} tokens in one step on Anchor KV")
    probs, spec.pending_probs = spec.pending_probs, None
    if spec.sampled and probs is None:
        raise RuntimeError(f"request {req.rid}: its draft distribution was not kept")
    spec.held.hold(new[0], probs)
    result = original(req, new_accepted_len)
    if req.finished_reason is not None:
        req.finished_reason = None
        req.finished_len = None
        decoder = lynx_speculation.current()
        assert decoder is not None
        decoder.park(req, ParkReason.FINISH)
    return result


def _park_before_retracting(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    decoder = lynx_speculation.current()
    speculating = [i for i, req in enumerate(batch.reqs) if lynx_speculation.is_speculating(req)]
    if decoder is None or not speculating:
        return original(batch, *args, **kwargs)
    for i in speculating:
        decoder.park(batch.reqs[i], ParkReason.MEMORY)
    # The decoder takes parked requests out at the start of the next iteration; until then
    # they must not be retracted (upstream would free their KV and requeue them).
    keep = [i for i in range(len(batch.reqs)) if i not in set(speculating)]
    parked = [batch.reqs[i] for i in speculating]
    batch.filter_batch(keep_indices=keep)
    decoder.hold_out_of_batch(parked)
    if batch.is_empty():
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

        return [], NewTokenRatioTracker.estimate_new_token_ratio_after_retract(parked), []
    return original(batch, *args, **kwargs)


def register() -> None:
    hook(UPDATE_FINISH_STATE, _hold_or_defer, "around")
    hook(RETRACT_DECODE, _park_before_retracting, "around")
