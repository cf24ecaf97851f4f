"""Phase 4 of a speculative decoding step and the outcomes of a speculation: verify the
held tokens of the requests whose Residual landed on every TP rank (one pass for all),
decide with :func:`lynx.verify.decide`, commit the accepted prefix and the correction, or
roll back to ``t_0`` and fail; then hand each request back to the engine. Scheduler
thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from lynx.metrics import LynxMetrics
from lynx.speculative.engine import DecodeEngine, RowStop
from lynx.speculative.speculation import Speculation, Speculations
from lynx.transfer import ProgressiveReceiver
from lynx.verify import (
    CommittedLogprobs,
    SpecState,
    SpeculationStats,
    WindowEstimator,
    acceptance_draws,
    committed_logprobs,
    decide,
    held_tokens_problem,
    kv_after_commit,
    report,
    row_rejects,
)

logger = logging.getLogger(__name__)


class Verifier:
    """See the module docstring. ``generator``: the acceptance rule's coin flips (every
    TP rank draws the same); ``tolerance``: the opt-in logit tolerance of greedy
    acceptance (0: exact)."""

    def __init__(
        self,
        engine: DecodeEngine,
        receiver: ProgressiveReceiver,
        book: Speculations,
        stats: SpeculationStats,
        window: WindowEstimator,
        metrics: LynxMetrics | None,
        *,
        generator: torch.Generator,
        tolerance: float,
        page_size: int,
    ) -> None:
        self._engine = engine
        self._receiver = receiver
        self._book = book
        self._stats = stats
        self._window = window
        self._metrics = metrics
        self._generator = generator
        self._tolerance = tolerance
        self._page_size = page_size

    def commit(
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
        spec = self._book.get(req)
        asked = spec.sampling.logprobs is not None
        committed = (logprobs or CommittedLogprobs()) if asked else None
        self._engine.commit_tokens(scheduler, req, 1 + accepted, correction, committed, spec.reasoning)
        tokens, allocated = len(self._engine.tokens(req)), self._engine.kv_allocated_len(req)
        commit = kv_after_commit(spec.prompt_len, tokens, allocated, self._page_size)
        self._engine.set_kv_len(scheduler, req, commit.kept, commit.free)

    def fail(self, scheduler: Any, req: Any, reason: str | None) -> None:
        """Roll back to ``t_0`` and finish the request: with ``reason`` (the Residual failed)
        or with the abort the client asked for."""
        spec = self._book.get(req)
        self.commit(scheduler, req, 0, None)
        spec.held.move(SpecState.FAILED)
        if reason is not None:
            rid = self._engine.request_id(req)
            logger.error("Lynx: request %s (room %s) failed: %s", rid, spec.room, reason)
            self._engine.abort_with(req, f"Lynx: {reason}")
        self._engine.check_finish(req, 1)
        self._stats.failed += 1
        if self._metrics is not None:
            self._metrics.failed()
        self._book.end(spec.room, drain=reason is None)
        self.hand_back(scheduler, req)

    def hand_back(self, scheduler: Any, req: Any) -> None:
        """Back to the engine: a finished request is released and answered now, any other
        re-enters through the waiting queue."""
        if self._engine.finished(req):
            self._engine.release_and_answer(scheduler, req)
        else:
            self._engine.requeue(scheduler, req)

    def verify_and_commit(self, scheduler: Any, reqs: list[Any], *, in_steps: bool) -> None:
        """Phase 4: check, verify (one pass for all), decide and commit each request.
        Timed apart (forward, commit): the verify pass must cost a few decode steps, and
        the stats say which part does not."""
        for req in reqs:
            self._book.get(req).held.verifying()
        verified, verify_s = self._verify_forward(
            scheduler, self._checked_for_verification(scheduler, reqs), in_steps
        )
        commit_started = time.monotonic()
        for req, rows, draws in verified:
            self._decide_and_commit(scheduler, req, rows, draws, verify_s)
        self._stats.commit_seconds += time.monotonic() - commit_started

    def _checked_for_verification(self, scheduler: Any, reqs: list[Any]) -> list[Any]:
        """A request whose held tokens cannot be verified fails alone, before the forward
        they would break for every request in it."""
        checked = []
        for req in reqs:
            spec = self._book.get(req)
            problem = (
                "its held tokens are out of step with its output"
                if list(self._engine.tokens(req)[1:]) != spec.held.tokens
                else held_tokens_problem(spec.held.tokens, spec.held.draft_probs, spec.sampling.vocab_size)
            )
            if problem is None:
                checked.append(req)
            else:
                self.fail(scheduler, req, f"cannot verify its held tokens: {problem}")
        return checked

    def _verify_forward(
        self, scheduler: Any, checked: list[Any], in_steps: bool
    ) -> tuple[list[tuple[Any, torch.Tensor | None, torch.Tensor | None]], float]:
        """The verify pass over the requests that hold tokens; returns each request left to
        decide with its logit rows (None: it holds nothing) and its acceptance draws (a
        sampled request's), and the pass's seconds. A request's rows end at its first
        rejection (:func:`lynx.verify.decision.row_rejects`). If the pass raises (a bug, a
        device fault), the requests in it fail and the server serves on."""
        drafted = [req for req in checked if len(self._engine.tokens(req)) > 1]
        undrafted: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = [
            (req, None, None) for req in checked if len(self._engine.tokens(req)) <= 1
        ]
        if not drafted:
            return undrafted, 0.0
        specs = [self._book.get(r) for r in drafted]
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
                tolerance=self._tolerance,
            )

        started = time.monotonic()
        try:
            logits = self._verify_rows(scheduler, specs, stop, in_steps)
        except Exception as exc:
            logger.exception("Lynx: the verify forward of %d requests failed", len(drafted))
            for req in drafted:
                self.fail(scheduler, req, f"the verify forward failed: {exc}")
            return undrafted, 0.0
        verify_s = time.monotonic() - started
        self._stats.verify_passes += 1
        self._stats.verify_seconds += verify_s
        verified = {id(req): (rows, d) for req, rows, d in zip(drafted, logits, draws, strict=True)}
        return [(req, *verified.get(id(req), (None, None))) for req in checked], verify_s

    def _verify_rows(
        self, scheduler: Any, specs: list[Speculation], stop: RowStop, in_steps: bool
    ) -> list[torch.Tensor]:
        """Each request's verify rows: those whose rows went layer by layer as the Residual
        landed (``SpeculativeDecoder._verify_ahead``) through the layers left, the others
        in one pass of ``run_verify_forward``."""
        ahead = [n for n, spec in enumerate(specs) if spec.layerwise is not None]
        rest = [n for n in range(len(specs)) if n not in ahead]
        logits: dict[int, torch.Tensor] = {}
        if rest:
            computed = self._engine.run_verify_forward(
                scheduler,
                [specs[n].req for n in rest],
                [specs[n].prompt_len for n in rest],
                in_steps=in_steps,
                stop=lambda m, i, row: stop(rest[m], i, row),
            )
            logits.update(zip(rest, computed, strict=True))
        for n in ahead:
            spec = specs[n]
            rows = spec.layerwise
            assert rows is not None
            spec.layers_ahead = rows.layers
            layers = self._receiver.refined_layers(spec.room)
            self._engine.advance_layerwise(scheduler, spec.req, spec.prompt_len, rows, layers)
            logits[n] = self._engine.layerwise_logits(scheduler, rows)
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
        spec = self._book.get(req)
        try:
            decision = decide(
                spec.held.tokens,
                rows,
                spec.sampling,
                draft_probs=spec.held.draft_probs,
                generator=self._generator,
                draws=draws,
                tolerance=self._tolerance,
            )
            logprobs = (
                committed_logprobs(rows, decision.committed(spec.held.tokens), spec.sampling.logprobs)
                if rows is not None and spec.sampling.logprobs is not None
                else None
            )
        except ValueError as exc:  # e.g. non-finite verify logits: this request only
            self.fail(scheduler, req, f"verifying its held tokens failed: {exc}")
            return
        if spec.last_held_at is not None:
            decoding_s = spec.last_held_at - spec.admitted_at
            self._window.observe_decoding(decision.held, decoding_s, spec.prompt_len)
        park_reason = spec.held.park_reason
        spec.held.committed(decision.accepted)
        self.commit(scheduler, req, decision.accepted, decision.correction, logprobs)
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
        self._stats.record(spec.report)
        if self._metrics is not None:
            self._metrics.speculated(spec.report)
        if len(tokens := self._engine.tokens(req)) > 1:
            # Finish checks (EOS, stop strings, max_new_tokens) over the committed run.
            self._engine.check_finish(req, len(tokens) - 1)
        self._book.end(spec.room, drain=False)
        self._book.report(spec)
        self.hand_back(scheduler, req)
