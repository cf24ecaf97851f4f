"""Parked speculative requests in the scheduler's view of what is alive
(``--lynx-mode speculative``).

A parked request (waiting for its Residual, out of every batch) still holds a request
row and KV pages.

Hook targets (``sglang.srt.`` omitted):
* ``managers.scheduler.Scheduler.is_fully_idle`` AFTER: not idle while any is parked, or
  upstream's idle memory check would count its pages as leaked (and the idle sleeper
  would stop polling for its Residual).
* ``managers.scheduler.Scheduler.collect_inflight_reqs`` AFTER: parked requests are in
  flight, so an abort (and a weight-version change) reaches them.
* ``managers.scheduler.Scheduler.pause_generation`` BEFORE: with ``mode="retract"``
  upstream retracts every running and staged request and rebuilds its KV from prefill;
  speculating and parked requests are rolled back to their committed tokens first
  (:meth:`SpeculativeDecoder.roll_back_for_retraction`), so no held token is rebuilt as if
  committed and no later refine writes into slots upstream freed.

Contract: scheduler thread; the idle and in-flight hooks are read-only on Lynx's side;
upstream's behaviour is unchanged without a speculative decoder.
"""

from __future__ import annotations

from typing import Any

from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

IS_FULLY_IDLE = "managers.scheduler.Scheduler.is_fully_idle"
COLLECT_INFLIGHT_REQS = "managers.scheduler.Scheduler.collect_inflight_reqs"
PAUSE_GENERATION = "managers.scheduler.Scheduler.pause_generation"


def _not_idle_while_parked(result: bool, *_args: Any, **_kwargs: Any) -> bool:
    decoder = runtime.speculative_decoder()
    return result and (decoder is None or not decoder.holds_kv_outside_batches())


def _with_parked(result: set[Any], *_args: Any, **_kwargs: Any) -> set[Any]:
    decoder = runtime.speculative_decoder()
    if decoder is not None:
        result.update(decoder.parked_requests())
    return result


def _roll_back_before_retraction(scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    decoder = runtime.speculative_decoder()
    if decoder is not None and upstream.pause_retracts(recv_req):
        # Under the overlap loop the step in flight delivers its tokens first (upstream
        # would process it next, after the roll-back, as committed output).
        upstream.process_in_flight_batch(scheduler)
        decoder.roll_back_for_retraction(scheduler)


def register() -> None:
    hook(IS_FULLY_IDLE, _not_idle_while_parked, "after")
    hook(COLLECT_INFLIGHT_REQS, _with_parked, "after")
    hook(PAUSE_GENERATION, _roll_back_before_retraction, "before")
