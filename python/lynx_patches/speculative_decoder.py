"""``--lynx-mode speculative`` on SGLang's decode scheduler: decode on the Anchor, hold
the tokens back, refine the prompt KV when the Residual lands, verify the held tokens on
the decode path, commit the accepted prefix plus the correction.

The hook modules call into the one :class:`SpeculativeDecoder` of the scheduler process
(``lynx_patches.runtime.current().decoder``); a request's state is one :class:`Speculation`
record, kept by the request's room (``bootstrap_room``, unique among the live requests of
a decode server: its receiver refuses a second request for a room in use) and looked up
for the very request object that holds it, so two live requests that share a client's
request id never see each other's state. What to accept, commit and report is decided by
``lynx.verify`` (:func:`lynx.verify.decide`); this class applies it to SGLang's objects,
through :mod:`lynx_patches.upstream`. The request's life (``lynx.verify.state``):

* the receiver decoded its Anchor and upstream committed the first token ``t_0`` (exact,
  from prefill): :meth:`SpeculativeDecoder.admit`. The request goes on through
  upstream's waiting queue and prebuilt batch like any other and decodes in the running
  batch, mixed with the others, on Anchor KV. Its tokens after ``t_0`` are held: the
  output streamer skips it (:mod:`lynx_patches.output_streamer`), a finish among held
  tokens is deferred (:mod:`lynx_patches.schedule_batch`).
* at the cap, a deferred finish or memory pressure it is PARKED: taken out of the running
  batch (it keeps its KV) until its Residual lands.
* every scheduler iteration, right after upstream's ``process_decode_queue`` (before the
  next batch is built), :meth:`SpeculativeDecoder.step` polls the Residuals and rewrites
  the prompt KV at full precision as far as each landed: the layers prefill reported
  landed so far (the request decodes on, on the layers refined and the others' Anchor),
  and every layer once the whole Residual did (the request decodes on until every TP
  rank has, :func:`lynx.verify.agree`). For those refined on every rank: under
  the overlap loop, first process the step still in flight (one bubble per verification;
  a parked request's late token is held); take them out of the batch, run the verify
  pass over ``t_0..t_{k-1}`` of all of them (one decode row per held position: in decode
  steps, the decode path's numerics bit for bit, or with ``--lynx-verify-pass batched``
  in ONE forward, :func:`lynx_patches.upstream.run_verify_forward`), accept, free the KV of rejected
  positions, check the finish over the committed run, and hand each request back:
  upstream's prebuilt path re-admits it with its committed tokens (streams them, seeds
  the next decode input), exactly as it resumes a retracted request; a request the
  committed run finished is released and answered right away.
* a Residual that fails or misses its deadline, or an abort while parked: roll back to
  ``t_0``, finish the request with the abort, release its KV and answer the client.

Greedy requests are verified by argmax. Sampled requests (temperature, top-k, top-p,
min-p) by the speculative-sampling rule: the distribution each held token was drawn from
is kept (:mod:`lynx_patches.model_runner`), so what is committed is distributed exactly as
full-precision sampling. Requested logprobs of committed tokens are recomputed from the
verify pass (:func:`lynx.verify.committed_logprobs`). Settings the verify pass cannot
reproduce exactly wait for the Residual instead of speculating
(:func:`lynx.verify.unverifiable_because`).

Contract: every method runs on the scheduler thread (hooks in the scheduler loop, the
sampler, the output streamer); none blocks except on the TP ranks' agreement, which
every rank reaches once per iteration. :meth:`SpeculativeDecoder.step` runs once per
iteration before the next batch is built (under the overlap loop the previous one may
be in flight); :meth:`admit` once per request; the rest may be called any number of times.

Imported at plugin registration, before SGLang may be imported: SGLang names are
imported where they are used.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lynx.metrics import LynxMetrics
from lynx.transfer import ProgressiveReceiver, RequestLayout, RoomReport, Verdict
from lynx.verify import (
    CommittedLogprobs,
    HeldTokens,
    ParkReason,
    ReduceMin,
    SamplingSettings,
    SpecState,
    SpeculationReport,
    SpeculationStats,
    VerifyPass,
    WindowEstimator,
    acceptance_draws,
    agree,
    committed_logprobs,
    decide,
    draft_probs,
    held_tokens_problem,
    kv_after_commit,
    report,
    row_rejects,
    speculation_window,
    unverifiable_because,
)
from lynx_patches import upstream

logger = logging.getLogger(__name__)

META_INFO_KEY = "lynx_transfer"
OTHER_RANK_FAILED = "its Residual failed on another TP rank of this decode server (see that rank's log)"
_HOLDING = (SpecState.SPECULATIVE, SpecState.PARKED, SpecState.VERIFYING)


@dataclass
class Speculation:
    """Lynx's state of one request in speculative mode, from admission to its end."""

    req: Any  # upstream's request, decoding on the Anchor, parked or waiting for its Residual
    room: int
    slots: torch.Tensor  # the prompt's KV slots, where the receiver writes
    prompt_len: int
    held: HeldTokens
    sampling: SamplingSettings
    admitted_at: float
    last_held_at: float | None = None
    transfer: RoomReport | None = None
    report: SpeculationReport | None = None
    # Sampled requests: the unfiltered probabilities tokens in flight are drawn from
    # (:func:`lynx.verify.tempered_probs`), oldest first (appended by the sampler hook,
    # filtered around the drawn token when it is held). The overlap loop
    # samples a step before the previous step's token is held: two may be in flight.
    pending_probs: deque[torch.Tensor] = field(default_factory=deque)
    draft_bytes: int = 0  # what its held draft distributions take
    refine_s: float = 0.0  # how long refining its KV took so far
    refined: bool = False  # every layer of its prompt KV is at full precision
    # Parked, with ``--lynx-verify-pass layers``: its held rows, run through each layer as
    # it is refined (:meth:`SpeculativeDecoder._verify_ahead`), and the time that took
    layerwise: upstream.LayerwiseRows | None = None
    verify_ahead_s: float = 0.0
    layers_ahead: int = 0  # the layers its rows had gone through when its Residual landed
    # Upstream's reasoning-token count after t_0 (upstream.reasoning_state): a commit
    # restores it and counts the committed tokens again.
    reasoning: tuple[Any, ...] = ()
    # Parked and taken out of every batch: it holds its KV outside upstream's batches.
    out_of_batch: bool = False

    @property
    def sampled(self) -> bool:
        return self.held.draft_probs is not None


class SpeculativeDecoder:
    def __init__(
        self,
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
    ) -> None:
        self.receiver = receiver
        # The acceptance rule's coin flips. TP ranks draw the same ones (``seed``: the
        # server's --random-seed, as upstream's sampler), so they commit the same tokens.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.max_tokens = max_tokens
        # Upstream's overlap loop: a step is launched before the last one's token is known,
        # so a parked request gets one late token, and Lynx processes the step in flight
        # before it takes requests out to verify or fail them.
        self.overlap = overlap
        self.tolerance = tolerance
        # The verify pass held tokens get: ``--lynx-verify-pass``, until ``layers`` (a
        # parked request's held rows run through each layer as its Residual refines it,
        # while the rest travels) proves unsupported on this server or fails: then
        # ``steps``. ``layers`` is "steps" for the window until the scheduler's model is
        # checked (upstream.layerwise_unsupported), before the first admission.
        self._verify_pass: VerifyPass = verify_pass
        self._layerwise_checked = verify_pass != "layers"
        self.draft_memory_bytes = draft_memory_bytes
        self.page_size = page_size
        self.metrics = metrics
        self.stats = SpeculationStats()
        self.window = WindowEstimator()
        # room -> the speculation of the request speculating, parked or waiting on it
        self._speculations: dict[int, Speculation] = {}
        self._draining: set[int] = set()  # rooms whose request ended before the Residual landed
        # Requests that waited for their Residual out of every batch and streamed t_0 when
        # they left the waiting queue: the chunk upstream's prebuilt path streams when they
        # join a batch again would repeat it with no new token.
        self._streamed_ahead: set[int] = set()  # id(req)

    # ---- what the hooks ask ---------------------------------------------------------------

    def speculation_of(self, req: Any) -> Speculation | None:
        spec = self._speculations.get(upstream.bootstrap_room(req))
        return spec if spec is not None and spec.req is req else None

    def is_speculating(self, req: Any) -> bool:
        """Decoding on Anchor KV right now (its new tokens are held)."""
        spec = self.speculation_of(req)
        return spec is not None and spec.held.state is SpecState.SPECULATIVE

    def takes_token(self, req: Any) -> bool:
        """A token ``req`` just decoded is to be held: it decodes on Anchor KV, or (overlap
        loop) it is the late token of a step launched before the request parked."""
        spec = self.speculation_of(req)
        if spec is None:
            return False
        if spec.held.state is SpecState.SPECULATIVE:
            return True
        return self.overlap and spec.held.state is SpecState.PARKED and not spec.held.late

    def holds_tokens(self, req: Any) -> bool:
        """Has tokens the client must not see yet."""
        spec = self.speculation_of(req)
        return (
            spec is not None
            and spec.held.state in _HOLDING
            and not req.finished()
            and len(req.output_ids) > 1
        )

    def sampled_rows(self) -> dict[int, Speculation]:
        """Request-pool row -> speculation of a sampled request decoding on the Anchor (its
        draft distributions are kept)."""
        return {
            upstream.req_pool_row(spec.req): spec
            for spec in self._speculations.values()
            if spec.sampled and spec.held.state is SpecState.SPECULATIVE
        }

    def streams(self, req: Any) -> bool:
        """``req`` is to be in the output batch being streamed now: it holds no unverified
        token, and is not a request whose t_0 streamed ahead with nothing new since."""
        if id(req) in self._streamed_ahead:
            self._streamed_ahead.discard(id(req))
            return not upstream.streamed_every_token(req)
        return not self.holds_tokens(req)

    def parked_requests(self) -> list[Any]:
        return [spec.req for spec in self._speculations.values() if spec.out_of_batch]

    def holds_kv_outside_batches(self) -> bool:
        return any(spec.out_of_batch for spec in self._speculations.values())

    # ---- from the hooks ---------------------------------------------------------------------

    def admit(self, req: Any, room: int, slots: torch.Tensor, vocab_size: int) -> None:
        """Upstream committed ``t_0``; the request's KV pages hold the Anchor."""
        sampling = upstream.sampling_settings(req, vocab_size)
        prompt_len = len(req.origin_input_ids)
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
        # The receiver refuses a second request for a room in use.
        assert room not in self._speculations, f"room {room} speculates for two requests"
        spec = Speculation(req, room, slots, prompt_len, held, sampling, time.monotonic())
        spec.reasoning = upstream.reasoning_state(req)
        self._speculations[room] = spec
        self.stats.active += 1
        # A streamed response carries request-level info with its first token only (now);
        # a non-streamed one gets the full report at the end.
        spec.transfer = self.receiver.report(room)
        self._report(req, spec)
        reason = unverifiable_because(sampling)
        if reason is not None:
            self._wait(spec, ParkReason.UNVERIFIABLE)
            logger.debug("Lynx: request %s waits for its Residual: %s", req.rid, reason)
        elif spec.sampled and self._draft_row_bytes(spec) > self.draft_memory_bytes - self.stats.draft_bytes:
            self._wait(spec, ParkReason.DRAFT_MEMORY)

    @property
    def verify_pass(self) -> VerifyPass:
        """The verify pass held tokens get (``layers`` only where upstream runs it)."""
        if self._verify_pass == "layers" and not self._layerwise_checked:
            return "steps"
        return self._verify_pass

    def _wait(self, spec: Speculation, reason: ParkReason) -> None:
        """Park a request that holds nothing: it waits for its Residual without drafting."""
        spec.held.park(reason)
        self.stats.waited += 1

    def hold(self, req: Any, token: int, *, finishes: bool = False) -> None:
        """``req`` decoded ``token`` on the Anchor (:meth:`takes_token`): hold it, parking the
        request if the token would finish it (``finishes``: upstream's finish check said so,
        which only counts once verified) or at the cap."""
        spec = self.speculation_of(req)
        assert spec is not None
        tempered = spec.pending_probs.popleft() if spec.pending_probs else None
        if spec.sampled and tempered is None:
            raise RuntimeError(f"request {req.rid}: its draft distribution was not kept")
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
        spec = self.speculation_of(req)
        assert spec is not None
        if spec.held.state is SpecState.SPECULATIVE:
            spec.held.park(reason)

    def hold_out_of_batch(self, reqs: Iterable[Any]) -> None:
        """``reqs`` (parked) were taken out of the running batch by the caller."""
        for req in reqs:
            self._spec(req).out_of_batch = True

    # ---- every scheduler iteration ----------------------------------------------------------

    def step(self, scheduler: Any, reduce_min: ReduceMin | None = None) -> None:
        """Poll the Residuals, refine the KV of those that landed, agree with the other TP
        ranks (``reduce_min``, :func:`lynx.verify.agree`; None: one rank), then verify and
        commit what every rank refined and fail what any rank failed."""
        self._layerwise_supported(scheduler)  # once, before its first request is admitted
        if self._draining:
            self._drain()
        if not self._speculations:
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
        upstream.remove_from_batches(scheduler, [req for req, _ in failed] + ready)
        for req, reason in failed:
            self._fail(scheduler, req, reason)
        if ready:
            self._verify_and_commit(scheduler, ready)

    def _poll_residuals(self) -> list[tuple[Any, Verdict, str | None]]:
        """Phase 1: each tracked request with its Residual's verdict on this rank (READY
        once refined here), ending those that finished meanwhile."""
        polled = []
        for room, spec in list(self._speculations.items()):
            req = spec.req
            if req.finished():  # aborted in a batch, or finished on t_0
                self._end(room, drain=True)
                continue
            if spec.out_of_batch and upstream.is_aborting(req):  # aborted while parked
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
        1-row decode step's calls (:func:`lynx_patches.upstream.advance_layerwise`): its
        logits are what ``steps`` computes, bit for bit. Under the overlap loop, the step
        in flight is processed first (one bubble per iteration that advances some)."""
        work = []
        for req in waiting:
            spec = self._spec(req)
            if not spec.out_of_batch or len(req.output_ids) <= 1:
                continue
            layers = self.receiver.refined_layers(spec.room)
            if layers > (0 if spec.layerwise is None else spec.layerwise.layers):
                work.append((spec, layers))
        if not work or not self._layerwise_supported(scheduler):
            return
        if self.overlap:
            upstream.process_in_flight_batch(scheduler)
        for spec, layers in work:
            if spec.req.finished():  # aborted in the step just processed: ended next poll
                continue
            started = time.monotonic()
            rows = spec.layerwise or upstream.LayerwiseRows()
            try:
                upstream.advance_layerwise(scheduler, spec.req, spec.prompt_len, rows, layers)
            except Exception:  # a Lynx bug: every verify pass runs in steps from now on
                logger.exception("Lynx: room %s: verifying its held tokens layer by layer failed", spec.room)
                self._verify_pass = "steps"
                for other in self._speculations.values():
                    other.layerwise = None
                return
            spec.layerwise = rows
            elapsed = time.monotonic() - started
            spec.verify_ahead_s += elapsed
            self.stats.verify_ahead_seconds += elapsed

    def _layerwise_supported(self, scheduler: Any) -> bool:
        if not self._layerwise_checked:
            why = upstream.layerwise_unsupported(scheduler)
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
        specs = [self._spec(req) for req, _, _ in polled]
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
        upstream.process_in_flight_batch(scheduler)
        self._take_out_parked(scheduler)
        for req in [*ready, *(req for req, _ in failed)]:
            if req.finished():  # aborted in that step: upstream released and answered it
                self._end(self._spec(req).room, drain=True)
        return (
            [req for req in ready if not req.finished()],
            [(req, reason) for req, reason in failed if not req.finished()],
        )

    def _refine(self, req: Any, *, landed: bool) -> tuple[Verdict, str | None]:
        """Rewrite the request's prompt KV at full precision as far as its Residual landed
        (``landed``: all of it): READY once every layer is, else WAIT."""
        spec = self._spec(req)
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
        for room, spec in list(self._speculations.items()):
            req = spec.req
            if req.finished():
                continue
            self._commit(scheduler, req, 0, None)
            spec.held.move(SpecState.FAILED)
            parked = spec.out_of_batch
            self.stats.rolled_back += 1
            self._end(room, drain=False)  # its receive space is quarantined until prefill releases it
            if parked:
                upstream.requeue(scheduler, req)

    def _take_out_parked(self, scheduler: Any) -> None:
        newly = [
            spec.req
            for spec in self._speculations.values()
            if not spec.out_of_batch and spec.held.state is SpecState.PARKED
        ]
        if not newly:
            return
        upstream.remove_from_batches(scheduler, newly)
        self.hold_out_of_batch(newly)
        for req in newly:
            # One that waits from its admission (window 0, sampling it cannot verify) never
            # joined a batch, whose prebuilt step streams t_0: the Anchor's TTFT is now.
            if not self._spec(req).held.tokens and upstream.first_stream_chunk(req):
                upstream.stream_now(scheduler, req)
                if not upstream.first_stream_chunk(req):
                    self._streamed_ahead.add(id(req))

    # ---- outcomes ---------------------------------------------------------------------------

    def _spec(self, req: Any) -> Speculation:
        spec = self.speculation_of(req)
        assert spec is not None, f"request {req.rid} is not tracked by Lynx"
        return spec

    def _commit(
        self,
        scheduler: Any,
        req: Any,
        accepted: int,
        correction: int | None,
        logprobs: CommittedLogprobs | None = None,
    ) -> None:
        """Keep ``t_0``, the first ``accepted`` held tokens and the correction (if any),
        with ``logprobs`` (theirs, from the verify pass) if the request asked for them;
        free the KV of the rest."""
        spec = self._spec(req)
        upstream.truncate_output(req, 1 + accepted)
        if correction is not None:
            upstream.append_output(req, correction)
        if spec.sampling.logprobs is not None:
            upstream.replace_output_logprobs(req, 1, logprobs or CommittedLogprobs())
        upstream.recount_reasoning(scheduler, req, spec.reasoning, req.output_ids[1:])
        commit = kv_after_commit(
            spec.prompt_len, len(req.output_ids), upstream.kv_allocated_len(req), self.page_size
        )
        upstream.set_kv_len(scheduler, req, commit.kept, commit.free)

    def _fail(self, scheduler: Any, req: Any, reason: str | None) -> None:
        """Roll back to ``t_0`` and finish the request: with ``reason`` (the Residual failed)
        or with the abort the client asked for."""
        spec = self._spec(req)
        self._commit(scheduler, req, 0, None)
        spec.held.move(SpecState.FAILED)
        if reason is not None:
            logger.error("Lynx: request %s (room %s) failed: %s", req.rid, spec.room, reason)
            upstream.abort_with(req, f"Lynx: {reason}")
        req.update_finish_state()
        self.stats.failed += 1
        if self.metrics is not None:
            self.metrics.failed()
        self._end(spec.room, drain=reason is None)
        self._hand_back(scheduler, req)

    @staticmethod
    def _hand_back(scheduler: Any, req: Any) -> None:
        """Back to upstream: a finished request is released and answered now, any other
        re-enters through the waiting queue."""
        if req.finished():
            upstream.release_and_answer(scheduler, req)
        else:
            upstream.requeue(scheduler, req)

    def _verify_and_commit(self, scheduler: Any, reqs: list[Any]) -> None:
        """Phase 4: check, verify (one pass for all), decide and commit each request.
        Timed apart (forward, commit): the verify pass must cost a few decode steps, and
        the stats say which part does not."""
        for req in reqs:
            self._spec(req).held.verifying()
        verified, verify_s = self._verify_forward(scheduler, self._checked_for_verification(scheduler, reqs))
        commit_started = time.monotonic()
        for req, rows, draws in verified:
            self._decide_and_commit(scheduler, req, rows, draws, verify_s)
        self.stats.commit_seconds += time.monotonic() - commit_started

    def _checked_for_verification(self, scheduler: Any, reqs: list[Any]) -> list[Any]:
        """A request whose held tokens cannot be verified fails alone, before the forward
        they would break for every request in it."""
        checked = []
        for req in reqs:
            spec = self._spec(req)
            problem = (
                "its held tokens are out of step with its output"
                if list(req.output_ids[1:]) != spec.held.tokens
                else held_tokens_problem(spec.held.tokens, spec.held.draft_probs, spec.sampling.vocab_size)
            )
            if problem is None:
                checked.append(req)
            else:
                self._fail(scheduler, req, f"cannot verify its held tokens: {problem}")
        return checked

    def _verify_forward(
        self, scheduler: Any, checked: list[Any]
    ) -> tuple[list[tuple[Any, torch.Tensor | None, torch.Tensor | None]], float]:
        """The verify pass over the requests that hold tokens; returns each request left to
        decide with its logit rows (None: it holds nothing) and its acceptance draws (a
        sampled request's), and the pass's seconds. A request's rows end at its first
        rejection (:func:`lynx.verify.decision.row_rejects`). If the pass raises (a bug, a
        device fault), the requests in it fail and the server serves on."""
        drafted = [req for req in checked if len(req.output_ids) > 1]
        undrafted: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = [
            (req, None, None) for req in checked if len(req.output_ids) <= 1
        ]
        if not drafted:
            return undrafted, 0.0
        specs = [self._spec(r) for r in drafted]
        draws = [acceptance_draws(spec.held.tokens, spec.sampling, self._generator) for spec in specs]

        def stop(n: int, i: int, row: torch.Tensor) -> bool:
            held = specs[n].held
            return row_rejects(
                i,
                row,
                held.tokens,
                specs[n].sampling,
                draft_probs=held.draft_probs,
                draws=draws[n],
                tolerance=self.tolerance,
            )

        started = time.monotonic()
        try:
            logits = self._verify_rows(scheduler, specs, stop)
        except Exception as exc:
            logger.exception("Lynx: the verify forward of %d requests failed", len(drafted))
            for req in drafted:
                self._fail(scheduler, req, f"the verify forward failed: {exc}")
            return undrafted, 0.0
        verify_s = time.monotonic() - started
        self.stats.verify_passes += 1
        self.stats.verify_seconds += verify_s
        verified = {id(req): (rows, d) for req, rows, d in zip(drafted, logits, draws, strict=True)}
        return [(req, *verified.get(id(req), (None, None))) for req in checked], verify_s

    def _verify_rows(
        self, scheduler: Any, specs: list[Speculation], stop: Callable[[int, int, torch.Tensor], bool]
    ) -> list[torch.Tensor]:
        """Each request's verify rows: those whose rows went layer by layer as the Residual
        landed (:meth:`_verify_ahead`) through the layers left, the others in one pass of
        ``run_verify_forward``."""
        ahead = [n for n, spec in enumerate(specs) if spec.layerwise is not None]
        rest = [n for n in range(len(specs)) if n not in ahead]
        logits: dict[int, torch.Tensor] = {}
        if rest:
            computed = upstream.run_verify_forward(
                scheduler,
                [specs[n].req for n in rest],
                [specs[n].prompt_len for n in rest],
                in_steps=self._verify_pass != "batched",
                stop=lambda m, i, row: stop(rest[m], i, row),
            )
            logits.update(zip(rest, computed, strict=True))
        for n in ahead:
            spec = specs[n]
            rows = spec.layerwise
            assert rows is not None
            spec.layers_ahead = rows.layers
            layers = self.receiver.refined_layers(spec.room)
            upstream.advance_layerwise(scheduler, spec.req, spec.prompt_len, rows, layers)
            logits[n] = upstream.layerwise_logits(scheduler, rows)
        return [logits[n] for n in range(len(specs))]

    def _decide_and_commit(
        self,
        scheduler: Any,
        req: Any,
        rows: torch.Tensor | None,
        draws: torch.Tensor | None,
        verify_s: float,
    ) -> None:
        """Accept the held prefix the verify rows agree with, commit it with the
        correction, report, and hand the request back to the decode loop."""
        spec = self._spec(req)
        try:
            decision = decide(
                spec.held.tokens,
                rows,
                spec.sampling,
                draft_probs=spec.held.draft_probs,
                generator=self._generator,
                draws=draws,
                tolerance=self.tolerance,
            )
            logprobs = (
                committed_logprobs(rows, decision.committed(spec.held.tokens), spec.sampling.logprobs)
                if rows is not None and spec.sampling.logprobs is not None
                else None
            )
        except ValueError as exc:  # e.g. non-finite verify logits: this request only
            self._fail(scheduler, req, f"verifying its held tokens failed: {exc}")
            return
        if spec.last_held_at is not None:
            self.window.observe_decoding(decision.held, spec.last_held_at - spec.admitted_at, spec.prompt_len)
        park_reason = spec.held.park_reason
        spec.held.committed(decision.accepted)
        self._commit(scheduler, req, decision.accepted, decision.correction, logprobs)
        spec.report = report(
            decision,
            window=spec.held.cap,
            park_reason=park_reason,
            anchor_to_commit_s=time.monotonic() - spec.admitted_at,
            verify_s=verify_s if rows is not None else 0.0,
            refine_s=spec.refine_s,
            verified_ahead_layers=spec.layers_ahead,
            verify_ahead_s=spec.verify_ahead_s,
        )
        self.stats.record(spec.report)
        if self.metrics is not None:
            self.metrics.speculated(spec.report)
        if len(req.output_ids) > 1:
            # Finish checks (EOS, stop strings, max_new_tokens) over the committed run.
            req.update_finish_state(len(req.output_ids) - 1)
        self._end(spec.room, drain=False)
        self._report(req, spec)
        self._hand_back(scheduler, req)

    # ---- bookkeeping ------------------------------------------------------------------------

    def _end(self, room: int, *, drain: bool) -> None:
        spec = self._speculations.pop(room, None)
        if spec is not None:
            self.stats.active -= 1
        if spec is not None and spec.held.draft_probs is not None:
            self.stats.draft_bytes -= spec.draft_bytes
            spec.draft_bytes = 0
            spec.held.draft_probs.clear()
        if drain and self.receiver.residual_verdict(room)[0] is Verdict.WAIT:
            self._draining.add(room)  # prefill still writes into its receive space
            return
        transfer = self.receiver.forget(room)
        if spec is not None:
            spec.transfer = transfer
        if transfer is not None and transfer.residual_latency_s and transfer.anchor_latency_s is not None:
            self.window.observe_residual(
                transfer.residual_bytes,
                transfer.residual_latency_s - transfer.anchor_latency_s,
                transfer.residual_space,
            )
        if transfer is not None and self.metrics is not None:
            self.metrics.observe(transfer)

    def _drain(self) -> None:
        for room in list(self._draining):
            if self.receiver.residual_verdict(room)[0] is not Verdict.WAIT:
                self._draining.discard(room)
                self.receiver.forget(room)

    @staticmethod
    def _report(req: Any, spec: Speculation) -> None:
        info = {} if spec.transfer is None else asdict(spec.transfer)
        if spec.report is not None:
            info["speculation"] = asdict(spec.report)
        upstream.set_request_info(req, META_INFO_KEY, info)
