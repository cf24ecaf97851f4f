"""Speculative requests in SGLang's batch bookkeeping (``--lynx-mode speculative``).

Hook targets (``sglang.srt.`` omitted):
* ``managers.schedule_batch.Req.update_finish_state`` AROUND: upstream calls it after each
  decode step appended a token. For a request decoding on Anchor KV (or the late token of
  a parked one, under the overlap loop), defer a finish it would cause (EOS, stop
  string, max_new_tokens: upstream's check runs first, its finish is cleared) and record
  the token as held, parking the request for that finish or at the cap: held tokens
  only count once verified. An abort passes
  through, with the output cut back to what was committed so no held token reaches the
  client.
* ``managers.schedule_batch.ScheduleBatch.retract_decode`` AROUND: under KV memory
  pressure, park the speculative requests (they stop growing and keep their KV until
  their Residual lands) before upstream retracts anything.

Contract: both run on the scheduler thread, inside upstream's decode-step processing;
without a speculative decoder (or for a request it does not track) they call the
original unchanged.
"""

from __future__ import annotations

from typing import Any

from lynx.verify import ParkReason
from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

UPDATE_FINISH_STATE = "managers.schedule_batch.Req.update_finish_state"
RETRACT_DECODE = "managers.schedule_batch.ScheduleBatch.retract_decode"


def _hold_or_defer(original: Any, req: Any, new_accepted_len: int = 1) -> Any:
    decoder = runtime.speculative_decoder()
    spec = decoder.speculations.of(req) if decoder is not None else None
    if decoder is None or spec is None or not decoder.speculations.takes_token(req):
        return original(req, new_accepted_len)
    if upstream.is_aborting(req):  # the client sees only committed tokens
        upstream.truncate_output(req, 1)
        return original(req, new_accepted_len)
    new = list(req.output_ids[1 + len(spec.held.tokens) :])
    if not new:  # the first token, from prefill: exact, its finish counts
        return original(req, new_accepted_len)
    if len(new) != 1:
        raise RuntimeError(f"request {req.rid}: {len(new)} tokens in one step on Anchor KV")
    result = original(req, new_accepted_len)
    finishes = req.finished_reason is not None
    if finishes:
        upstream.clear_finish(req)
    decoder.hold(req, new[0], finishes=finishes)
    return result


def _park_before_retracting(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    decoder = runtime.speculative_decoder()
    speculating = (
        [i for i, req in enumerate(batch.reqs) if decoder.speculations.is_speculating(req)]
        if decoder is not None
        else []
    )
    if decoder is None or not speculating:
        return original(batch, *args, **kwargs)
    parked = [batch.reqs[i] for i in speculating]
    for req in parked:
        decoder.park(req, ParkReason.MEMORY)
    # The decoder takes parked requests out at the start of the next iteration; until then
    # they must not be retracted (upstream would free their KV and requeue them).
    upstream.batch_without(batch, speculating)
    decoder.speculations.hold_out_of_batch(parked)
    if batch.is_empty():
        return upstream.nothing_retracted(parked)
    return original(batch, *args, **kwargs)


def register() -> None:
    hook(UPDATE_FINISH_STATE, _hold_or_defer, "around")
    hook(RETRACT_DECODE, _park_before_retracting, "around")
