"""Parked speculative requests in the scheduler's view of what is alive
(``--lynx-mode speculative``); prefill's chunks announced before their forward
(``--lynx-layerwise-from``).

A parked request (waiting for its Residual, out of every batch) still holds a request
row and KV pages.

Hook targets (``sglang.srt.`` omitted):
* ``managers.scheduler.Scheduler.run_batch`` BEFORE (prefill, ``--lynx-layerwise-from``):
  each PD request whose chunk this forward computes announces the pages it will send
  (:meth:`lynx.transfer.ProgressiveSender.begin_chunk`), so that its Anchor can leave
  layer by layer (:mod:`lynx_patches.radix_attention`).
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

import logging
from typing import Any

from lynx import settings
from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

logger = logging.getLogger(__name__)

RUN_BATCH = "managers.scheduler.Scheduler.run_batch"
IS_FULLY_IDLE = "managers.scheduler.Scheduler.is_fully_idle"
COLLECT_INFLIGHT_REQS = "managers.scheduler.Scheduler.collect_inflight_reqs"
PAUSE_GENERATION = "managers.scheduler.Scheduler.pause_generation"


def _announce_chunks(scheduler: Any, batch: Any, *_args: Any, **_kwargs: Any) -> None:
    lynx = runtime.current()
    sender = None if lynx is None else lynx.sender
    if sender is None:
        return
    try:
        for room, pages in upstream.chunks_to_send(scheduler, batch):
            sender.begin_chunk(room, pages)
    except Exception:  # a Lynx bug: these chunks go whole once computed, the forward runs
        logger.exception("Lynx: announcing the batch's chunks failed; they are sent once computed")


def _not_idle_while_parked(result: bool, *_args: Any, **_kwargs: Any) -> bool:
    decoder = runtime.speculative_decoder()
    return result and (decoder is None or not decoder.speculations.holds_kv_outside_batches())


def _with_parked(result: set[Any], *_args: Any, **_kwargs: Any) -> set[Any]:
    decoder = runtime.speculative_decoder()
    if decoder is not None:
        result.update(decoder.speculations.parked_requests())
    return result


def _roll_back_before_retraction(scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    decoder = runtime.speculative_decoder()
    if decoder is not None and upstream.pause_retracts(recv_req):
        # Under the overlap loop the step in flight delivers its tokens first (upstream
        # would process it next, after the roll-back, as committed output).
        upstream.process_in_flight_batch(scheduler)
        decoder.roll_back_for_retraction(scheduler)


def register() -> None:
    if settings.layerwise():
        hook(RUN_BATCH, _announce_chunks, "before")
    hook(IS_FULLY_IDLE, _not_idle_while_parked, "after")
    hook(COLLECT_INFLIGHT_REQS, _with_parked, "after")
    hook(PAUSE_GENERATION, _roll_back_before_retraction, "before")
