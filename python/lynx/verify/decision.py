"""The per-request decisions of speculative mode, as pure functions: may a request
speculate at all (:func:`unverifiable_because`), what its verify pass commits
(:func:`decide`), and what is reported about it (:func:`report`).

The SGLang side only adapts: it reads a request's sampling settings into
:class:`SamplingSettings`, hands the held tokens and the verify pass's logits to
:func:`decide`, and applies the :class:`VerifyDecision` to the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lynx.verify.acceptance import (
    bf16_ulp,
    greedy_agreement,
    greedy_rejections,
    log_prob_gaps,
    sampling_rejections,
    verify_greedy,
    verify_sampling,
)
from lynx.verify.sampling import SamplingSettings, target_probs
from lynx.verify.state import ParkReason
from lynx.verify.stats import SpeculationReport


def unverifiable_because(sampling: SamplingSettings) -> str | None:
    """Why the verify pass could not reproduce this request's token choice exactly (then
    it waits for the Residual instead of speculating), or None."""
    s = sampling
    checks = (
        (s.grammar, "a grammar"),
        (s.penalties, "penalties"),
        (s.min_new_tokens, "min_new_tokens"),
        (s.logit_bias, "logit_bias"),
        (s.custom_logit_processor, "a custom logit processor"),
        (s.hidden_states, "hidden states"),
        (s.watermark, "a watermark"),
        (s.per_token_outputs, "per-token outputs (sampling mask, routed experts or indexer top-k)"),
    )
    return next((name for present, name in checks if present), None)


def held_tokens_problem(
    held: Sequence[int], draft_probs: Sequence[torch.Tensor] | None, vocab_size: int
) -> str | None:
    """Why ``held`` (and a sampled request's draft distributions) cannot go into a verify
    pass, or None: a token outside the vocabulary would break the whole batch's forward,
    a non-finite or token-less draft distribution the acceptance rule."""
    bad = [t for t in held if not 0 <= t < vocab_size]
    if bad:
        return f"held token {bad[0]} is outside the vocabulary of {vocab_size}"
    if draft_probs is None:
        return None
    if len(draft_probs) != len(held):
        return f"{len(draft_probs)} draft distributions for {len(held)} held tokens"
    for i, (token, q) in enumerate(zip(held, draft_probs, strict=True)):
        if q.shape != (vocab_size,):
            return f"draft distribution {i} has shape {tuple(q.shape)}, not ({vocab_size},)"
        if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
            return f"draft distribution {i} is not finite and non-negative"
        if not float(q[token]) > 0:
            return f"held token {i} ({token}) has no probability under its own draft distribution"
    return None


@dataclass(frozen=True)
class VerifyDecision:
    """What one request's verify pass commits: ``t_0``, the first ``accepted`` held tokens,
    then ``correction`` (the full-precision choice where the first held token was
    rejected), if any."""

    held: int
    accepted: int
    correction: int | None
    # greedy: of the ``verified`` rows, those whose held token is the full-precision argmax
    # (teacher-forced on the draft)
    agreed: int | None
    verified: int = 0  # verify rows computed: the pass stops a request's rows at a rejection
    # greedy, after a rejection: the rejected token's log-probability gap to the best one
    # (near 0: a near-tie the kernels break either way; large: the Anchor misled the draft),
    # and that gap in BF16 ulps of the best logit (<= 1: a tie BF16 logits cannot resolve)
    rejection_gap: float | None = None
    rejection_gap_ulps: float | None = None

    @property
    def rejected(self) -> bool:
        return self.correction is not None

    def committed(self, held: Sequence[int]) -> list[int]:
        """The tokens it commits after ``t_0``, given the ``held`` tokens it decided on."""
        return [*held[: self.accepted], *([] if self.correction is None else [self.correction])]


def acceptance_draws(
    held: Sequence[int], sampling: SamplingSettings, generator: torch.Generator | None
) -> torch.Tensor | None:
    """A sampled request's uniform acceptance draws, one per held token, drawn before its
    verify pass so that :func:`row_rejects` and :func:`decide` judge each row alike;
    None for a greedy request (its rule draws nothing)."""
    return None if sampling.greedy else torch.rand(len(held), generator=generator, dtype=torch.float64)


def row_rejects(
    i: int,
    row: torch.Tensor,
    held: Sequence[int],
    sampling: SamplingSettings,
    *,
    draft_probs: Sequence[torch.Tensor] | None = None,
    draws: torch.Tensor | None = None,
    tolerance: float = 0.0,
) -> bool:
    """Whether verify row ``i`` (the (vocab,) logits predicting held token ``i``) rejects
    that token by the rule :func:`decide` applies to it: the verify pass computes that
    request's rows no further (the rest would be rolled back whatever they say)."""
    token = torch.tensor([held[i]], dtype=torch.int64)
    if sampling.greedy:
        return bool(greedy_rejections(token, row[None], tolerance)[0])
    if draft_probs is None or draws is None:
        raise ValueError("a sampled request needs its draft distributions and acceptance draws")
    draft = draft_probs[i][None].float().cpu()
    return bool(sampling_rejections(token, draft, target_probs(row[None], sampling), draws[i : i + 1])[0])


def decide(
    held: Sequence[int],
    logits: torch.Tensor | None,
    sampling: SamplingSettings,
    *,
    draft_probs: Sequence[torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
    tolerance: float = 0.0,
) -> VerifyDecision:
    """Verify ``held`` (tokens decoded on the Anchor after ``t_0``) against ``logits``,
    the verify pass's (m, vocab) rows on the refined KV (row i predicts held token i).

    ``logits`` None: the request holds no token (nothing to verify). Greedy requests keep
    the longest prefix equal to the argmax; sampled ones follow the speculative-sampling
    rule with ``draft_probs`` (the distribution each held token was drawn from) against
    :func:`lynx.verify.sampling.target_probs` of ``logits``, with ``draws`` (from
    :func:`acceptance_draws`; else drawn from ``generator``).
    ``tolerance`` > 0 relaxes greedy acceptance (:func:`lynx.verify.verify_greedy`).

    m < k rows: the pass stopped at a rejection (:func:`row_rejects`); the held tokens past
    row m - 1 are rolled back unjudged. Should those rows all accept after all, the first m
    are committed with no correction, which the next decode step continues from."""
    if logits is None:
        if held:
            raise ValueError(f"{len(held)} held tokens but no verify logits")
        return VerifyDecision(held=0, accepted=0, correction=None, agreed=None)
    verified = min(logits.shape[0], len(held))
    tokens = torch.tensor(list(held[:verified]), dtype=torch.int64)
    gap = gap_ulps = None
    if sampling.greedy:
        outcome = verify_greedy(tokens, logits, tolerance)
        agreed: int | None = greedy_agreement(tokens, logits)
        if outcome.rejected:
            gap = float(log_prob_gaps(tokens, logits)[outcome.accepted])
            gap_ulps = gap / bf16_ulp(float(logits[outcome.accepted].max()))
    else:
        if draft_probs is None or len(draft_probs) != len(held):
            raise ValueError("a sampled request needs the draft distribution of every held token")
        outcome = verify_sampling(
            tokens,
            torch.stack(list(draft_probs[:verified])).float().cpu(),
            target_probs(logits, sampling),
            generator=generator,
            draws=draws,
        )
        agreed = None
    correction = outcome.tokens[-1] if outcome.rejected else None
    return VerifyDecision(
        held=len(held),
        accepted=outcome.accepted,
        correction=correction,
        agreed=agreed,
        verified=verified,
        rejection_gap=gap,
        rejection_gap_ulps=gap_ulps,
    )


def report(
    decision: VerifyDecision,
    *,
    window: int,
    park_reason: ParkReason | None,
    anchor_to_commit_s: float,
    verify_s: float,
    refine_s: float = 0.0,
    verified_ahead_layers: int = 0,
    verify_ahead_s: float = 0.0,
) -> SpeculationReport:
    """The request's speculation report (its ``meta_info``, metrics, server stats);
    ``verify_s``: the verify pass it was part of (0 without one); ``verified_ahead_layers``
    and ``verify_ahead_s``: the layers its verify rows went through before its Residual
    landed, and the time that took (``--lynx-verify-pass layers``)."""
    return SpeculationReport(
        held=decision.held,
        window=window,
        accepted=decision.accepted,
        agreed=decision.agreed,
        rejected=decision.rejected,
        rejection_gap=decision.rejection_gap,
        rejection_gap_ulps=decision.rejection_gap_ulps,
        park_reason=None if park_reason is None else park_reason.value,
        anchor_to_commit_s=anchor_to_commit_s,
        verify_s=verify_s,
        refine_s=refine_s,
        verified=decision.verified,
        verified_ahead_layers=verified_ahead_layers,
        verify_ahead_s=verify_ahead_s,
    )
