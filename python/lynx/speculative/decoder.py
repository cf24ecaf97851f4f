"""``--lynx-mode speculative`` on a decode engine: decode on the Anchor, hold the tokens
back, refine the prompt KV when the Residual lands, verify the held tokens on the decode
path, commit the accepted prefix plus the correction.

The engine's hooks call into the one :class:`SpeculativeDecoder` of the scheduler process,
which reaches the engine's requests, batches and forward passes only through a
:class:`~lynx.speculative.engine.DecodeEngine`; a request's state is one
:class:`~lynx.speculative.speculation.Speculation`, in the decoder's book of them
(:attr:`SpeculativeDecoder.speculations`, which also answers what the hooks ask of a
request). What to accept, commit and report is decided by ``lynx.verify``
(:func:`lynx.verify.decide`); :mod:`lynx.speculative.verifier` applies it. The request's
life (``lynx.verify.state``):

* the receiver decoded its Anchor and the engine committed the first token ``t_0``
  (exact, from prefill): :meth:`SpeculativeDecoder.admit`. The request goes on through
  the engine's waiting queue and prebuilt batch like any other and decodes in the running
  batch, mixed with the others, on Anchor KV. Its tokens after ``t_0`` are held: the
  output streamer skips it, a finish among held tokens is deferred.
* at the cap, a deferred finish or memory pressure it is PARKED: taken out of the running
  batch (it keeps its KV) until its Residual lands.
* every scheduler iteration, right after the engine processed its decode results (before
  the next batch is built), :meth:`SpeculativeDecoder.step` polls the Residuals and
  rewrites the prompt KV at full precision as far as each landed: the layers prefill
  reported landed so far (the request decodes on, on the layers refined and the others'
  Anchor), and every layer once the whole Residual did (the request decodes on until
  every TP rank has, :func:`lynx.verify.agree`). For those refined on every rank: under
  the overlap loop, first process the step still in flight (one bubble per verification;
  a parked request's late token is held); take them out of the batch, run the verify
  pass over ``t_0..t_{k-1}`` of all of them (one decode row per held position: in decode
  steps, the decode path's numerics bit for bit, or with ``--lynx-verify-pass batched``
  in ONE forward), accept, free the KV of rejected positions, check the finish over the
  committed run, and hand each request back: the engine re-admits it with its committed
  tokens (streams them, seeds the next decode input), exactly as it resumes a retracted
  request; a request the committed run finished is released and answered right away.
* a Residual that fails or misses its deadline, or an abort while parked: roll back to
  ``t_0``, finish the request with the abort, release its KV and answer the client.

Greedy requests are verified by argmax. Sampled requests (temperature, top-k, top-p,
min-p) by the speculative-sampling rule: the distribution each held token was drawn from
is kept (by the sampler's hook), so what is committed is distributed exactly as
full-precision sampling. Requested logprobs of committed tokens are recomputed from the
verify pass (:func:`lynx.verify.committed_logprobs`). Settings the verify pass cannot
reproduce exactly wait for the Residual instead of speculating
(:func:`lynx.verify.unverifiable_because`).

Contract: every method runs on the scheduler thread (hooks in the scheduler loop, the
sampler, the output streamer); none blocks except on the TP ranks' agreement, which
every rank reaches once per iteration. :meth:`SpeculativeDecoder.step` runs once per
iteration before the next batch is built (under the overlap loop the previous one may
be in flight); :meth:`SpeculativeDecoder.admit` once per request; the rest may be called
any number of times.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from lynx.first_token import StreamedAhead
from lynx.metrics import LynxMetrics
from lynx.speculative.engine import DecodeEngine
from lynx.speculative.speculation import Speculation, Speculations
from lynx.speculative.verifier import Verifier
from lynx.transfer import ProgressiveReceiver, RequestLayout
from lynx.verdict import Verdict
from lynx.verify import (
    HeldTokens,
    ParkReason,
    ReduceMin,
    SpecState,
    SpeculationStats,
    VerifyPass,
    WindowEstimator,
    agree,
    draft_probs,
    speculation_window,
    unverifiable_because,
)

logger = logging.getLogger(__name__)

OTHER_RANK_FAILED = "its Residual failed on another TP rank of this decode server (see that rank's log)"


class SpeculativeDecoder:
    """See the module docstring. ``engine``: the serving engine's operations;
    ``max_tokens``: the most tokens a request holds; ``tolerance``: the opt-in logit
    tolerance of greedy acceptance (0: exact); ``verify_pass``: ``--lynx-verify-pass``;
    ``draft_memory_bytes``: what sampled requests' draft distributions may hold in all;
    ``seed``: the acceptance rule's (the server's ``--random-seed``, as every TP rank's);
    ``overlap``: the engine runs the overlap loop."""

    def __init__(
        self,
        engine: DecodeEngine,
        receiver: ProgressiveReceiver,
        max_tokens: int,
        page_size: int,
        metrics: LynxMetrics | None,
        *,
        tolerance: float = 0.0,
        verify_pass: VerifyPass = "steps",
        draft_memory_bytes: int = 256 << 20,
        seed: int | None = None,
        overlap: bool = False,
        streamed_ahead: StreamedAhead | None = None,
    ) -> None:
        self._engine = engine
        self.receiver = receiver
        # requests whose t_0 streamed before they joined a batch (shared with the runtime's
        # early first tokens: the output streamer leaves their next, empty chunk out)
        self.streamed_ahead = StreamedAhead() if streamed_ahead is None else streamed_ahead
        # The acceptance rule's coin flips. TP ranks draw the same ones (``seed``: the
        # server's --random-seed, as upstream's sampler), so they commit the same tokens.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.max_tokens = max_tokens
        # The engine's overlap loop: a step is launched before the last one's token is known,
        # so a parked request gets one late token, and Lynx processes the step in flight
        # before it takes requests out to verify or fail them.
        self.overlap = overlap
        # The verify pass held tokens get: ``--lynx-verify-pass``, until ``layers`` (a
        # parked request's held rows run through each layer as its Residual refines it,
        # while the rest travels) proves unsupported on this server or fails: then
        # ``steps``. ``layers`` is "steps" for the window until the scheduler's model is
        # checked (DecodeEngine.layerwise_unsupported), before the first admission.
        self._verify_pass: VerifyPass = verify_pass
        self._layerwise_checked = verify_pass != "layers"
        self.draft_memory_bytes = draft_memory_bytes
        self.stats = SpeculationStats()
        self.window = WindowEstimator()
        # the speculations of the requests speculating, parked or waiting on their Residual
        self.speculations = Speculations(engine, receiver, self.stats, self.window, metrics, overlap=overlap)
        self._verifier = Verifier(
            engine,
            receiver,
            self.speculations,
            self.stats,
            self.window,
            metrics,
            generator=self._generator,
            tolerance=tolerance,
            page_size=page_size,
        )

    # ---- from the hooks ---------------------------------------------------------------------

    def admit(self, req: Any, room: int, slots: torch.Tensor, vocab_size: int) -> None:
        """The engine committed ``t_0``; the request's KV pages hold the Anchor."""
        sampling = self._engine.sampling(req, vocab_size)
        prompt_len = self._engine.prompt_len(req)
        window = speculation_window(
            max_tokens=self.max_tokens,
            flight_s=self.window.expected_flight_s(
                RequestLayout.of(self.receiver.handshake, slots.numel()).sent_residual_nbytes
            ),
            step_s=self.window.expected_step_s(prompt_len),
            agreement=self.stats.agreement_rate,
            verify_pass=self.verify_pass,
        )
        if self.overlap:  # one parked at its cap in a batch holds the late token too
            window = max(0, window - 1)
        held = HeldTokens(window, draft_probs=None if sampling.greedy else [])
        spec = Speculation(req, room, slots, prompt_len, held, sampling, time.monotonic())
        spec.reasoning = self._engine.reasoning_state(req)
        self.speculations.add(spec)
        # A streamed response carries request-level info with its first token only (now);
        # a non-streamed one gets the full report at the end.
        spec.transfer = self.receiver.report(room)
        self.speculations.report(spec)
        reason = unverifiable_because(sampling)
        if reason is not None:
            self._wait(spec, ParkReason.UNVERIFIABLE)
            logger.debug("Lynx: request %s waits for its Residual: %s", self._engine.request_id(req), reason)
        elif spec.sampled and self._draft_row_bytes(spec) > self.draft_memory_bytes - self.stats.draft_bytes:
            self._wait(spec, ParkReason.DRAFT_MEMORY)

    @property
    def verify_pass(self) -> VerifyPass:
        """The verify pass held tokens get (``layers`` only where the engine runs it)."""
        if self._verify_pass == "layers" and not self._layerwise_checked:
            return "steps"
        return self._verify_pass

    def _wait(self, spec: Speculation, reason: ParkReason) -> None:
        """Park a request that holds nothing: it waits for its Residual without drafting."""
        spec.held.park(reason)
        self.stats.waited += 1

    def hold(self, req: Any, token: int, *, finishes: bool = False) -> None:
        """``req`` decoded ``token`` on the Anchor (:meth:`Speculations.takes_token`): hold it, parking the
        request if the token would finish it (``finishes``: the engine's finish check said so,
        which only counts once verified) or at the cap."""
        spec = self.speculations.get(req)
        tempered = spec.pending_probs.popleft() if spec.pending_probs else None
        if spec.sampled and tempered is None:
            raise RuntimeError(f"request {self._engine.request_id(req)}: its draft distribution was not kept")
        probs = None if tempered is None else draft_probs(tempered, spec.sampling, token)
        if spec.held.state is SpecState.PARKED:
            spec.held.hold_late(token, probs)
        else:
            if not spec.held.tokens:
                self.stats.requests += 1
            spec.held.hold(token, probs, finishes=finishes)
        spec.last_held_at = time.monotonic()
        if probs is not None:
            self._count_drafts(spec, probs.numel() * probs.element_size())
            # The next token's distribution must fit too, or the request stops drafting.
            if (
                spec.held.state is SpecState.SPECULATIVE
                and self.stats.draft_bytes + self._draft_row_bytes(spec) > self.draft_memory_bytes
            ):
                spec.held.park(ParkReason.DRAFT_MEMORY)

    def _count_drafts(self, spec: Speculation, nbytes: int) -> None:
        spec.draft_bytes += nbytes
        self.stats.draft_bytes += nbytes
        self.stats.draft_bytes_peak = max(self.stats.draft_bytes_peak, self.stats.draft_bytes)

    @staticmethod
    def _draft_row_bytes(spec: Speculation) -> int:
        return spec.sampling.vocab_size * 4  # float32, as draft_probs returns it

    def park(self, req: Any, reason: ParkReason) -> None:
        spec = self.speculations.get(req)
        if spec.held.state is SpecState.SPECULATIVE:
            spec.held.park(reason)

    # ---- every scheduler iteration ----------------------------------------------------------

    def step(self, scheduler: Any, reduce_min: ReduceMin | None = None) -> None:
        """Poll the Residuals, refine the KV of those that landed, agree with the other TP
        ranks (``reduce_min``, :func:`lynx.verify.agree`; None: one rank), then verify and
        commit what every rank refined and fail what any rank failed."""
        self._layerwise_supported(scheduler)  # once, before its first request is admitted
        self.speculations.drain()
        if not self.speculations:
            return
        self._take_out_parked(scheduler)
        polled = self._poll_residuals()
        self._verify_ahead(scheduler, [req for req, verdict, _ in polled if verdict is Verdict.WAIT])
        if not polled:
            return
        ready, failed = self._agree(polled, reduce_min)
        self._take_out_parked(scheduler)
        if not ready and not failed:
            return
        if self.overlap:
            ready, failed = self._settle_step_in_flight(scheduler, ready, failed)
        self._engine.remove_from_batches(scheduler, [req for req, _ in failed] + ready)
        for req, reason in failed:
            self._verifier.fail(scheduler, req, reason)
        if ready:
            self._verifier.verify_and_commit(scheduler, ready, in_steps=self._verify_pass != "batched")

    def _poll_residuals(self) -> list[tuple[Any, Verdict, str | None]]:
        """Phase 1: each tracked request with its Residual's verdict on this rank (READY
        once refined here), ending those that finished meanwhile."""
        polled = []
        for spec in self.speculations:
            req, room = spec.req, spec.room
            if self._engine.finished(req):  # aborted in a batch, or finished on t_0
                self.speculations.end(room, drain=True)
                continue
            if spec.out_of_batch and self._engine.is_aborting(req):  # aborted while parked
                verdict, reason = Verdict.FAIL, None
            else:
                verdict, reason = self.receiver.residual_verdict(room)
                if verdict is Verdict.FAIL:
                    reason = reason or "the Residual did not arrive"
                else:
                    verdict, reason = self._refine(req, landed=verdict is Verdict.READY)
            polled.append((req, verdict, reason))
        return polled

    def _verify_ahead(self, scheduler: Any, waiting: list[Any]) -> None:
        """Run the held rows of each parked request through the layers its Residual has
        refined since the last iteration (``waiting``: its Residual is still in flight),
        so that the verify pass left when it lands is the last layers'. Each row makes a
        1-row decode step's calls (:meth:`DecodeEngine.advance_layerwise`): its
        logits are what ``steps`` computes, bit for bit. Under the overlap loop, the step
        in flight is processed first (one bubble per iteration that advances some)."""
        work = []
        for req in waiting:
            spec = self.speculations.get(req)
            if not spec.out_of_batch or len(self._engine.tokens(req)) <= 1:
                continue
            layers = self.receiver.refined_layers(spec.room)
            if layers > (0 if spec.layerwise is None else spec.layerwise.layers):
                work.append((spec, layers))
        if not work or not self._layerwise_supported(scheduler):
            return
        if self.overlap:
            self._engine.process_in_flight_batch(scheduler)
        for spec, layers in work:
            if self._engine.finished(spec.req):  # aborted in the step just processed: ended next poll
                continue
            started = time.monotonic()
            rows = spec.layerwise or self._engine.new_layer_rows()
            try:
                self._engine.advance_layerwise(scheduler, spec.req, spec.prompt_len, rows, layers)
            except Exception:  # a Lynx bug: every verify pass runs in steps from now on
                logger.exception("Lynx: room %s: verifying its held tokens layer by layer failed", spec.room)
                self._verify_pass = "steps"
                for other in self.speculations:
                    other.layerwise = None
                return
            spec.layerwise = rows
            elapsed = time.monotonic() - started
            spec.verify_ahead_s += elapsed
            self.stats.verify_ahead_seconds += elapsed

    def _layerwise_supported(self, scheduler: Any) -> bool:
        if not self._layerwise_checked:
            why = self._engine.layerwise_unsupported(scheduler)
            if why is not None:
                logger.warning(
                    "Lynx: held tokens are verified in decode steps once the Residual lands, not "
                    "layer by layer as it does (--lynx-verify-pass layers): %s",
                    why,
                )
                self._verify_pass = "steps"
            self._layerwise_checked = True
        return self._verify_pass == "layers"

    def _agree(
        self, polled: list[tuple[Any, Verdict, str | None]], reduce_min: ReduceMin | None
    ) -> tuple[list[Any], list[tuple[Any, str | None]]]:
        """Phase 2: what every TP rank decided (READY everywhere, FAIL anywhere) and the
        agreed windows; returns (ready, [(failed, reason)])."""
        specs = [self.speculations.get(req) for req, _, _ in polled]
        agreement = agree(
            [spec.room for spec in specs],
            [spec.held.cap for spec in specs],
            [verdict for _, verdict, _ in polled],
            reduce_min,
        )
        ready, failed = [], []
        for n, ((req, _, reason), spec) in enumerate(zip(polled, specs, strict=True)):
            spec.held.cap = agreement.windows[n]  # lowered only for requests that hold nothing yet
            if spec.held.cap == 0 and spec.held.state is SpecState.SPECULATIVE:
                self._wait(spec, ParkReason.CAP)  # a window of 0: taken out before it decodes
            if agreement.verdicts[n] is Verdict.READY:
                ready.append(req)
            elif agreement.verdicts[n] is Verdict.FAIL:
                failed.append((req, OTHER_RANK_FAILED if agreement.others_failed[n] else reason))
        return ready, failed

    def _settle_step_in_flight(
        self, scheduler: Any, ready: list[Any], failed: list[tuple[Any, str | None]]
    ) -> tuple[list[Any], list[tuple[Any, str | None]]]:
        """Phase 3, overlap loop only: one bubble per verification. The step in flight
        delivers its tokens (held, or the late token of a parked request) before these
        requests leave the batch; those it finished (an abort) are ended here."""
        self._engine.process_in_flight_batch(scheduler)
        self._take_out_parked(scheduler)
        finished = self._engine.finished
        for req in [*ready, *(req for req, _ in failed)]:
            if finished(req):  # aborted in that step: the engine released and answered it
                self.speculations.end(self.speculations.get(req).room, drain=True)
        return (
            [req for req in ready if not finished(req)],
            [(req, reason) for req, reason in failed if not finished(req)],
        )

    def _refine(self, req: Any, *, landed: bool) -> tuple[Verdict, str | None]:
        """Rewrite the request's prompt KV at full precision as far as its Residual landed
        (``landed``: all of it): READY once every layer is, else WAIT."""
        spec = self.speculations.get(req)
        if spec.refined:
            return Verdict.READY, None
        started = time.monotonic()
        try:
            spec.refined = self.receiver.write_kv(spec.room, spec.slots)
            if landed and not spec.refined:
                raise RuntimeError("the Residual landed but the KV was not refined")
        except Exception as exc:  # corrupt bytes or a Lynx bug: this request fails, not the server
            logger.exception("Lynx: room %s: refining its KV failed", spec.room)
            return Verdict.FAIL, f"refining the received KV failed: {exc}"
        elapsed = time.monotonic() - started
        spec.refine_s += elapsed
        self.stats.refine_seconds += elapsed
        # What landed while it waited is READY at the next poll, with the TP ranks' agreement.
        return (Verdict.READY if landed else Verdict.WAIT), None

    def roll_back_for_retraction(self, scheduler: Any) -> None:
        """Upstream is about to retract every running and staged request and rebuild its
        KV from prefill (``pause_generation(mode="retract")``). Roll each speculating or
        parked request back to its committed tokens (``t_0``) and end its speculation
        first: its held tokens were never verified, and its receive space and prompt
        slots must not be written after upstream freed them. Parked requests go back to
        the waiting queue, which upstream retracts with the rest."""
        for spec in self.speculations:
            req = spec.req
            if self._engine.finished(req):
                continue
            self._verifier.commit(scheduler, req, 0, None)
            spec.held.move(SpecState.FAILED)
            parked = spec.out_of_batch
            self.stats.rolled_back += 1
            self.speculations.end(spec.room, drain=False)  # quarantined until prefill releases it
            if parked:
                self._engine.requeue(scheduler, req)

    def _take_out_parked(self, scheduler: Any) -> None:
        newly = [
            spec.req
            for spec in self.speculations
            if not spec.out_of_batch and spec.held.state is SpecState.PARKED
        ]
        if not newly:
            return
        self._engine.remove_from_batches(scheduler, newly)
        self.speculations.hold_out_of_batch(newly)
        for req in newly:
            # One that waits from its admission (window 0, sampling it cannot verify) never
            # joined a batch, whose prebuilt step streams t_0: the Anchor's TTFT is now.
            if not self.speculations.get(req).held.tokens and self._engine.first_chunk_pending(req):
                self._engine.stream_now(scheduler, req)
                if not self._engine.first_chunk_pending(req):
                    self.streamed_ahead.add(req)
