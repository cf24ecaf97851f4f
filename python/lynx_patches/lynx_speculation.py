"""``--lynx-mode speculative`` on SGLang's decode scheduler: decode on the Anchor, hold
the tokens back, refine the prompt KV when the Residual lands, verify the held tokens in
one forward pass, commit the accepted prefix plus the correction.

The hook modules call into the one :class:`SpeculativeDecoder` of the scheduler process
(:func:`current`); a request's state is ``req.lynx_spec`` (:class:`Speculation`). The
request's life (``lynx.verify.state``):

* the receiver decoded its Anchor and upstream committed the first token ``t_0`` (exact,
  from prefill): :meth:`SpeculativeDecoder.admit`. The request goes on through
  upstream's waiting queue and prebuilt batch like any other and decodes in the running
  batch, mixed with the others, on Anchor KV. Its tokens after ``t_0`` are held: the
  output streamer skips it (:mod:`lynx_patches.output_streamer`), a finish among held
  tokens is deferred (:mod:`lynx_patches.schedule_batch`).
* at the cap, a deferred finish or memory pressure it is PARKED: taken out of the running
  batch (it keeps its KV) until its Residual lands.
* every scheduler iteration, right after upstream's ``process_decode_queue`` (the
  non-overlap loop is quiescent there), :meth:`SpeculativeDecoder.step` polls the
  Residuals. For each that landed: take the request out of the batch, rewrite its prompt
  KV at full precision, run ONE extend forward over ``t_0..t_{k-1}`` for all of them
  (logits at every position), accept, free the KV of rejected positions, check the finish
  over the committed run, and hand the request back: upstream's prebuilt path re-admits it
  with its committed tokens (streams them, seeds the next decode input), exactly as it
  resumes a retracted request; a request the committed run finished is released and
  answered right away.
* a Residual that fails or misses its deadline, or an abort while parked: roll back to
  ``t_0``, finish the request with the abort, release its KV and answer the client.

Greedy requests are verified by argmax. Requests sampled at a temperature (no top-k,
top-p or min-p) by the speculative-sampling rule: the distribution each held token was
drawn from is kept (:mod:`lynx_patches.model_runner`), so what is committed is distributed
exactly as full-precision sampling. Settings the verify pass cannot reproduce exactly
wait for the Residual instead of speculating (:func:`unverifiable_because`).

Imported at plugin registration, before SGLang may be imported: SGLang names are
imported where they are used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

import torch

from lynx.transfer import ProgressiveReceiver, RoomReport, Verdict
from lynx.transfer.metrics import TransferMetrics
from lynx.verify import (
    HeldTokens,
    ParkReason,
    SpecState,
    SpeculationReport,
    SpeculationStats,
    greedy_agreement,
    kv_after_commit,
    verify_greedy,
    verify_sampling,
)

logger = logging.getLogger(__name__)

ATTR = "lynx_spec"
META_INFO_KEY = "lynx_transfer"
_HOLDING = (SpecState.SPECULATIVE, SpecState.PARKED, SpecState.VERIFYING)

# Set while Lynx runs its verify forward: logits at every position, not just the last.
verify_pass = threading.local()


@dataclass
class Speculation:
    """Lynx's state on one request (``req.lynx_spec``)."""

    room: int
    slots: torch.Tensor  # the prompt's KV slots, where the receiver writes
    prompt_len: int
    held: HeldTokens
    admitted_at: float
    transfer: RoomReport | None = None
    report: SpeculationReport | None = None
    # Sampled requests: the distribution the next token is being drawn from (set by the
    # sampler hook, taken when the token is held).
    pending_probs: torch.Tensor | None = None

    @property
    def sampled(self) -> bool:
        return self.held.draft_probs is not None


def speculation_of(req: Any) -> Speculation | None:
    return getattr(req, ATTR, None)


def is_speculating(req: Any) -> bool:
    """Decoding on Anchor KV right now (its new tokens are held)."""
    spec = speculation_of(req)
    return spec is not None and spec.held.state is SpecState.SPECULATIVE


def holds_tokens(req: Any) -> bool:
    """Has tokens the client must not see yet."""
    spec = speculation_of(req)
    return spec is not None and spec.held.state in _HOLDING and not req.finished() and len(req.output_ids) > 1


def is_greedy(req: Any) -> bool:
    return req.sampling_params.top_k == 1  # upstream's normalisation of temperature 0


def unverifiable_because(req: Any, vocab_size: int) -> str | None:
    """Why the verify pass could not reproduce this request's token choice exactly."""
    params = req.sampling_params
    checks = (
        (not is_greedy(req) and params.top_k < vocab_size, "top-k sampling"),
        (params.top_p < 1.0, "top-p sampling"),
        (params.min_p > 0.0, "min-p sampling"),
        (req.return_logprob, "logprobs"),
        (req.grammar is not None, "a grammar"),
        (
            params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0,
            "penalties",
        ),
        (params.min_new_tokens, "min_new_tokens"),
        (params.logit_bias, "logit_bias"),
        (getattr(req, "custom_logit_processor", None), "a custom logit processor"),
        (getattr(req, "return_hidden_states", False), "hidden states"),
        (getattr(req, "watermark", None) is not None, "a watermark"),
    )
    return next((name for present, name in checks if present), None)


_decoder: SpeculativeDecoder | None = None


def current() -> SpeculativeDecoder | None:
    """This scheduler process's decoder (None unless it decodes with --lynx-mode speculative)."""
    return _decoder


class SpeculativeDecoder:
    def __init__(
        self,
        receiver: ProgressiveReceiver,
        cap: int,
        page_size: int,
        metrics: TransferMetrics | None,
    ) -> None:
        global _decoder
        self.receiver = receiver
        # The acceptance rule's coin flips; seeded from the OS, like upstream's sampler.
        self._generator = torch.Generator()
        self._generator.seed()
        self.cap = cap
        self.page_size = page_size
        self.metrics = metrics
        self.stats = SpeculationStats()
        self._tracked: dict[int, Any] = {}  # room -> request speculating, parked or waiting
        self._parked: dict[int, Any] = {}  # room -> request out of every batch, holding its KV
        self._draining: set[int] = set()  # rooms whose request ended before the Residual landed
        _decoder = self

    # ---- from the hooks ---------------------------------------------------------------------

    def admit(self, req: Any, room: int, slots: torch.Tensor, vocab_size: int) -> None:
        """Upstream committed ``t_0``; the request's KV pages hold the Anchor."""
        held = HeldTokens(self.cap, draft_probs=None if is_greedy(req) else [])
        spec = Speculation(room, slots, len(req.origin_input_ids), held, time.monotonic())
        setattr(req, ATTR, spec)
        self._tracked[room] = req
        self.stats.active += 1
        # A streamed response carries request-level info with its first token only (now);
        # a non-streamed one gets the full report at the end.
        spec.transfer = self.receiver.report(room)
        self._report(req, spec)
        reason = unverifiable_because(req, vocab_size)
        if reason is not None:
            spec.held.park(ParkReason.UNVERIFIABLE)
            self.stats.waited += 1
            logger.debug("Lynx: request %s waits for its Residual: %s", req.rid, reason)
        else:
            self.stats.requests += 1

    def park(self, req: Any, reason: ParkReason) -> None:
        spec = speculation_of(req)
        assert spec is not None
        if spec.held.state is SpecState.SPECULATIVE:
            spec.held.park(reason)

    def hold_out_of_batch(self, reqs: Iterable[Any]) -> None:
        """``reqs`` (parked) were taken out of the running batch by the caller."""
        for req in reqs:
            spec = speculation_of(req)
            assert spec is not None
            self._parked[spec.room] = req

    def sampled_rows(self) -> dict[int, Any]:
        """Request-pool row -> sampled request decoding on the Anchor (its draft
        distributions are kept)."""
        return {
            req.kv.req_pool_idx: req
            for req in self._tracked.values()
            if is_speculating(req) and speculation_of(req).sampled
        }

    def parked_requests(self) -> Iterable[Any]:
        return self._parked.values()

    def holds_kv_outside_batches(self) -> bool:
        return bool(self._parked)

    # ---- every scheduler iteration ----------------------------------------------------------

    def step(self, scheduler: Any) -> None:
        if self._draining:
            self._drain()
        if not self._tracked:
            return
        self._take_out_parked(scheduler)
        ready, failed = [], []
        for room, req in list(self._tracked.items()):
            if req.finished():  # aborted in a batch, or finished on t_0
                self._end(room, drain=True)
                continue
            if room in self._parked and req.to_finish is not None:  # aborted while parked
                failed.append((req, None))
                continue
            verdict, reason = self.receiver.residual_verdict(room)
            if verdict is Verdict.DECODE:
                ready.append(req)
            elif verdict is Verdict.FAIL:
                failed.append((req, reason or "the Residual did not arrive"))
        if not ready and not failed:
            return
        self._take_out(scheduler, [req for req, _ in failed] + ready)
        for req, reason in failed:
            self._fail(scheduler, req, reason)
        if ready:
            self._verify_and_commit(scheduler, ready)

    def _take_out_parked(self, scheduler: Any) -> None:
        newly = [
            req
            for room, req in self._tracked.items()
            if room not in self._parked and speculation_of(req).held.state is SpecState.PARKED
        ]
        if newly:
            self._take_out(scheduler, newly)
            self.hold_out_of_batch(newly)

    @staticmethod
    def _take_out(scheduler: Any, reqs: list[Any]) -> None:
        """Remove ``reqs`` from the running batch and the waiting queue (they keep their KV)."""
        ids = {id(req) for req in reqs}
        batch = scheduler.running_batch
        if any(id(req) in ids for req in batch.reqs):
            batch.filter_batch(keep_indices=[i for i, req in enumerate(batch.reqs) if id(req) not in ids])
        if any(id(req) in ids for req in scheduler.waiting_queue):
            scheduler.waiting_queue = [req for req in scheduler.waiting_queue if id(req) not in ids]

    # ---- outcomes ---------------------------------------------------------------------------

    def _commit(self, scheduler: Any, req: Any, accepted: int, correction: int | None) -> None:
        """Keep ``t_0``, the first ``accepted`` held tokens and the correction (if any);
        free the KV of the rest."""
        spec = speculation_of(req)
        assert spec is not None
        del req.output_ids[1 + accepted :]
        if correction is not None:
            req.output_ids.append(correction)
        commit = kv_after_commit(
            spec.prompt_len, len(req.output_ids), req.kv.kv_allocated_len, self.page_size
        )
        if commit.free is not None:
            scheduler.tree_cache.free_kv_row(req.kv, [commit.free])
        req.kv.kv_committed_len = req.kv.kv_allocated_len = commit.kept

    def _fail(self, scheduler: Any, req: Any, reason: str | None) -> None:
        """Roll back to ``t_0`` and finish the request: with ``reason`` (the Residual failed)
        or with the abort the client asked for (``req.to_finish``)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        spec = speculation_of(req)
        assert spec is not None
        self._commit(scheduler, req, 0, None)
        spec.held.move(SpecState.FAILED)
        if reason is not None:
            logger.error("Lynx: request %s (room %s) failed: %s", req.rid, spec.room, reason)
            req.to_finish = FINISH_ABORT(f"Lynx: {reason}", HTTPStatus.INTERNAL_SERVER_ERROR)
        req.update_finish_state()
        self.stats.failed += 1
        if self.metrics is not None:
            self.metrics.failed()
        self._end(spec.room, drain=reason is None)
        self._hand_back(scheduler, req)

    @staticmethod
    def _hand_back(scheduler: Any, req: Any) -> None:
        """Back to upstream: a finished request is released and answered here, as
        upstream's prebuilt path would (which refuses finished requests); any other
        re-enters through the waiting queue, like a resumed retracted request."""
        if not req.finished():
            scheduler.waiting_queue.append(req)
            return
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, scheduler.tree_cache, checkpoint=True)
        scheduler.output_streamer.stream_output([req], req.return_logprob)

    def _verify_and_commit(self, scheduler: Any, reqs: list[Any]) -> None:
        refined = []
        for req in reqs:
            spec = speculation_of(req)
            assert spec is not None
            spec.held.verifying()
            try:
                if not self.receiver.decode(spec.room, spec.slots):
                    raise RuntimeError("the Residual landed but the KV was not refined")
            except Exception as exc:  # corrupt bytes or a Lynx bug: this request fails, not the server
                logger.exception("Lynx: room %s: refining its KV failed", spec.room)
                self._fail(scheduler, req, f"refining the received KV failed: {exc}")
                continue
            refined.append(req)
        reqs = refined
        drafted = [req for req in reqs if len(req.output_ids) > 1]
        started = time.monotonic()
        logits = self._forward(scheduler, drafted) if drafted else []
        verify_s = time.monotonic() - started
        if drafted:
            self.stats.verify_passes += 1
            self.stats.verify_seconds += verify_s
        by_req = {id(req): rows for req, rows in zip(drafted, logits, strict=True)}
        for req in reqs:
            spec = speculation_of(req)
            assert spec is not None
            if list(req.output_ids[1:]) != spec.held.tokens:
                raise RuntimeError(f"request {req.rid}: held tokens out of step with its output")
            held = torch.tensor(spec.held.tokens, dtype=torch.int64)
            rows = by_req.get(id(req))
            agreed = None
            if rows is None:
                accepted, correction = 0, None
            else:
                if spec.sampled:
                    assert spec.held.draft_probs is not None
                    temperature = float(req.sampling_params.temperature)
                    outcome = verify_sampling(
                        held,
                        torch.stack(spec.held.draft_probs).float().cpu(),
                        torch.softmax(rows / temperature, dim=-1),
                        generator=self._generator,
                    )
                else:
                    outcome = verify_greedy(held, rows)
                    agreed = greedy_agreement(held, rows)
                accepted = outcome.accepted
                correction = outcome.tokens[-1] if outcome.rejected else None
            park_reason = spec.held.park_reason
            spec.held.committed(accepted)
            self._commit(scheduler, req, accepted, correction)
            spec.report = SpeculationReport(
                held=held.numel(),
                accepted=accepted,
                agreed=agreed,
                rejected=correction is not None,
                park_reason=None if park_reason is None else park_reason.value,
                anchor_to_commit_s=time.monotonic() - spec.admitted_at,
                verify_s=verify_s if rows is not None else 0.0,
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

    def _forward(self, scheduler: Any, reqs: list[Any]) -> list[torch.Tensor]:
        """One extend forward over ``t_0..t_{k-1}`` of each request on its refined prompt
        KV, rewriting the KV of those positions in place; returns each request's (k, vocab)
        logits."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

        device = scheduler.req_to_token_pool.device
        table = scheduler.req_to_token_pool.req_to_token
        prefix_lens, extend_lens, seq_lens, rows, tokens, slots = [], [], [], [], [], []
        for req in reqs:
            spec = speculation_of(req)
            assert spec is not None
            k = len(req.output_ids) - 1
            if req.kv.kv_allocated_len != spec.prompt_len + k:
                raise RuntimeError(
                    f"request {req.rid}: {req.kv.kv_allocated_len} KV slots for a prompt of "
                    f"{spec.prompt_len} and {k} held tokens"
                )
            row = req.kv.req_pool_idx
            prefix_lens.append(spec.prompt_len)
            extend_lens.append(k)
            seq_lens.append(spec.prompt_len + k)
            rows.append(row)
            tokens.extend(req.output_ids[:k])
            slots.append(table[row, spec.prompt_len : spec.prompt_len + k])
        batch = ScheduleBatch.init_new(
            reqs,
            scheduler.req_to_token_pool,
            scheduler.token_to_kv_pool_allocator,
            scheduler.tree_cache,
            scheduler.model_config,
            False,
            scheduler.spec_algorithm,
        )
        batch.forward_mode = ForwardMode.EXTEND
        batch.prefix_lens = prefix_lens
        batch.extend_lens = extend_lens
        batch.extend_num_tokens = sum(extend_lens)
        batch.extend_logprob_start_lens = list(extend_lens)
        batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        batch.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        batch.orig_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        batch.seq_lens_sum = sum(seq_lens)
        batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64, device=device)
        batch.req_pool_indices_cpu = torch.tensor(rows, dtype=torch.int64)
        batch.out_cache_loc = torch.cat(slots).to(torch.int64)
        batch.input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        batch.multimodal_inputs = [None] * len(reqs)
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, scheduler.model_config.vocab_size)
        verify_pass.active = True
        try:
            result = scheduler.tp_worker.forward_batch_generation(batch, is_verify=True)
        finally:
            verify_pass.active = False
        logits = result.logits_output.next_token_logits
        if logits.shape[0] != batch.extend_num_tokens:
            raise RuntimeError(
                f"verify forward gave {logits.shape[0]} logit rows for {batch.extend_num_tokens}"
            )
        return list(logits.float().cpu().split(extend_lens))

    # ---- bookkeeping ------------------------------------------------------------------------

    def _end(self, room: int, *, drain: bool) -> None:
        req = self._tracked.pop(room, None)
        self._parked.pop(room, None)
        if req is not None:
            self.stats.active -= 1
        if drain and self.receiver.residual_verdict(room)[0] is Verdict.WAIT:
            self._draining.add(room)  # prefill still writes into its receive space
            return
        report = self.receiver.forget(room)
        spec = speculation_of(req) if req is not None else None
        if spec is not None:
            spec.transfer = report
        if report is not None and self.metrics is not None:
            self.metrics.observe(report)

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
        if req.customized_info is None:
            req.customized_info = {}
        req.customized_info[META_INFO_KEY] = [info]
