"""Which held tokens survive verification against full-precision KV.

A request decoded ``k`` tokens on Anchor KV (the *draft*: tokens ``t_1..t_k``, sampled
from the Anchor-phase distributions ``q_1..q_k``). When the Residual lands, one forward
over ``t_0..t_{k-1}`` on the refined KV gives the full-precision distributions
``p_1..p_k`` (``p_i`` predicts position ``i``; ``t_0`` is the exact first token). A
forward over ``t_0..t_k`` also gives ``p_{k+1}``, the *bonus* row; the decode server
does without it (its KV slot for ``t_k`` does not exist yet, and the next decode step
samples that token from full precision anyway).

* Greedy: keep the longest prefix with ``t_i == argmax p_i``, then append
  ``argmax p_{m+1}`` (the correction; with the bonus row also after all ``k`` matched).
* Sampling (temperature > 0): the speculative-sampling rule (Leviathan et al. 2023,
  Chen et al. 2023). Accept ``t_i`` with probability ``min(1, p_i(t_i) / q_i(t_i))``; at
  the first rejection sample the replacement from ``norm(max(0, p_i - q_i))``; if all
  are accepted sample the bonus token from ``p_{k+1}`` when given. The committed tokens
  are then distributed exactly as if every one had been sampled from ``p``.

``p`` and ``q`` must be the distributions the sampler would really use (after
temperature, top-k/top-p, penalties); settings whose distribution cannot be rebuilt for
the verify pass are the caller's to refuse (they wait for the Residual instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyOutcome:
    """``accepted`` of the ``held`` tokens survive; ``tokens`` is what to commit: the
    accepted held tokens, then the correction after a rejection (or the bonus token,
    when the bonus row was given)."""

    held: int
    accepted: int
    tokens: list[int]

    @property
    def rejected(self) -> bool:
        return self.accepted < self.held


def _check(held: torch.Tensor, p: torch.Tensor) -> int:
    if held.dim() != 1 or held.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"held tokens must be a 1-D integer tensor, got {held.dtype} {held.dim()}-D")
    k = held.numel()
    if p.dim() != 2 or p.shape[0] not in (k, k + 1) or p.shape[0] == 0:
        raise ValueError(
            f"need {k} or {k + 1} (with the bonus row) full-precision rows for {k} held tokens, "
            f"got shape {tuple(p.shape)}"
        )
    if k and (int(held.min()) < 0 or int(held.max()) >= p.shape[1]):
        raise ValueError("a held token is outside the vocabulary")
    return k


def verify_greedy(held: torch.Tensor, full_logits: torch.Tensor, tolerance: float = 0.0) -> VerifyOutcome:
    """Greedy acceptance. ``full_logits``: (k or k + 1, vocab), row i predicts position i + 1.

    ``tolerance`` 0: a held token is accepted only if it is the argmax (exact: what
    full-precision greedy decoding picks). ``tolerance`` T > 0 (opt-in): also if its
    full-precision log-probability is within T of the best one at its position; the
    correction after a rejection is still the argmax.
    """
    k = _check(held, full_logits)
    target = full_logits.argmax(dim=-1)
    mismatch = greedy_rejections(held, full_logits, tolerance).nonzero()
    m = int(mismatch[0]) if mismatch.numel() else k
    tail = [int(target[m])] if m < target.numel() else []
    return VerifyOutcome(held=k, accepted=m, tokens=[*held[:m].tolist(), *tail])


def greedy_rejections(held: torch.Tensor, full_logits: torch.Tensor, tolerance: float = 0.0) -> torch.Tensor:
    """Per held token, whether greedy acceptance (:func:`verify_greedy`) rejects it taken
    alone; each depends only on its own row, so a verify pass can judge its rows as they
    come and stop at the first rejection."""
    k = _check(held, full_logits)
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if tolerance == 0:
        return full_logits[:k].argmax(dim=-1) != held
    return log_prob_gaps(held, full_logits) > tolerance


def log_prob_gaps(held: torch.Tensor, full_logits: torch.Tensor) -> torch.Tensor:
    """Per held token: how far its full-precision log-probability is below the best one at
    its position (0 for the argmax or an exact tie), float64."""
    k = _check(held, full_logits)
    logp = torch.log_softmax(full_logits[:k].double(), dim=-1)
    return logp.max(dim=-1).values - logp[torch.arange(k), held]


def bf16_ulp(value: float) -> float:
    """BF16's unit in the last place at ``value`` (8 significant bits): the smallest gap two
    BF16 logits of that size can show. A greedy rejection whose gap is at most one is a
    near-tie that BF16 rounding decides, not a draft the Anchor misled."""
    if value == 0.0 or not math.isfinite(value):
        return 2.0**-133  # BF16's smallest subnormal
    return 2.0 ** (math.floor(math.log2(abs(value))) - 7)


def greedy_agreement(held: torch.Tensor, full_logits: torch.Tensor) -> int:
    """How many held tokens equal the full-precision argmax at their position, given the
    held tokens before them (teacher-forced on the draft): a per-token measure of how
    close Anchor decoding is, where acceptance stops at the first miss."""
    k = _check(held, full_logits)
    return int((full_logits[:k].argmax(dim=-1) == held).sum())


def sampling_rejections(
    held: torch.Tensor, draft_probs: torch.Tensor, full_probs: torch.Tensor, draws: torch.Tensor
) -> torch.Tensor:
    """Per held token, whether the speculative-sampling rule (:func:`verify_sampling`)
    rejects it taken alone, given its uniform draw ``draws[i]``: each depends only on
    its own rows and draw, so a verify pass can stop at the first rejection."""
    q, p = _normalised_pair(held, draft_probs, full_probs)
    return _rejections(held, q, p, draws)


def _normalised_pair(
    held: torch.Tensor, draft_probs: torch.Tensor, full_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, p): the draft and full rows checked and renormalised, in float64."""
    k = _check(held, full_probs)
    if draft_probs.shape != (k, full_probs.shape[1]):
        raise ValueError(f"draft_probs must be ({k}, {full_probs.shape[1]}), got {tuple(draft_probs.shape)}")
    pair = []
    for name, probs in (("draft_probs", draft_probs), ("full_probs", full_probs)):
        if not torch.isfinite(probs).all() or (probs < 0).any():
            raise ValueError(f"{name} must be finite and non-negative")
        pair.append(probs.double() / probs.double().sum(-1, keepdim=True))
    return pair[0], pair[1]


def _rejections(held: torch.Tensor, q: torch.Tensor, p: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    k = held.numel()
    if draws.shape[0] < k:
        raise ValueError(f"{draws.shape[0]} uniform draws for {k} held tokens")
    rows = torch.arange(k)
    p_tok, q_tok = p[rows, held], q[rows, held]
    if (q_tok <= 0).any():
        raise ValueError("a held token has zero probability under its own draft distribution")
    return draws[:k].double() * q_tok > p_tok  # u < p/q accepts, without dividing


def verify_sampling(
    held: torch.Tensor,
    draft_probs: torch.Tensor,
    full_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
) -> VerifyOutcome:
    """Speculative-sampling acceptance.

    ``draft_probs``: (k, vocab), the Anchor-phase distribution each held token was drawn
    from; ``full_probs``: (k or k + 1, vocab) from the verify pass. Rows need not be normalised
    exactly (they are renormalised); negative or non-finite entries raise. ``draws``:
    the acceptance draws, one per held token, drawn before the verify pass that judged
    its rows as they came (else drawn here from ``generator``).
    """
    q, p = _normalised_pair(held, draft_probs, full_probs)
    k = held.numel()
    u = torch.rand(k, generator=generator, dtype=torch.float64) if draws is None else draws
    rejected = _rejections(held, q, p, u).nonzero()
    if not rejected.numel():
        bonus = [int(torch.multinomial(p[k], 1, generator=generator))] if p.shape[0] > k else []
        return VerifyOutcome(held=k, accepted=k, tokens=[*held.tolist(), *bonus])
    m = int(rejected[0])
    residual = (p[m] - q[m]).clamp_min(0)
    # p != q at a rejection, so the positive part has mass; guard float dust anyway.
    weights = residual if residual.sum() > 0 else p[m]
    replacement = int(torch.multinomial(weights, 1, generator=generator))
    return VerifyOutcome(held=k, accepted=m, tokens=[*held[:m].tolist(), replacement])
