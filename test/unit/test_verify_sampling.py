"""The sampled distribution rebuilt from logits (``lynx.verify.sampling``), and the
speculative-sampling rule on filtered distributions."""

from __future__ import annotations

import dataclasses

import torch

from lynx.verify import (
    SamplingSettings,
    draft_probs,
    filter_probs,
    held_tokens_problem,
    target_probs,
    tempered_probs,
    verify_sampling,
)

VOCAB = 6
P = torch.tensor([[0.05, 0.40, 0.25, 0.15, 0.10, 0.05]], dtype=torch.float64)


def test_no_filter_is_the_identity() -> None:
    assert torch.equal(filter_probs(P.clone(), VOCAB, 1.0, 0.0), P)


def test_top_k_keeps_the_k_likeliest() -> None:
    out = filter_probs(P.clone(), 2, 1.0, 0.0)
    assert out.tolist() == [[0.0, 0.40, 0.25, 0.0, 0.0, 0.0]]


def test_top_p_keeps_tokens_while_the_mass_above_them_is_within_p() -> None:
    # mass above each in rank order: 0, 0.40, 0.65, 0.80, ...: top_p 0.65 keeps three
    out = filter_probs(P.clone(), VOCAB, 0.65, 0.0)
    assert out.tolist() == [[0.0, 0.40, 0.25, 0.15, 0.0, 0.0]]


def test_min_p_drops_tokens_below_a_share_of_the_best() -> None:
    out = filter_probs(P.clone(), VOCAB, 1.0, 0.3)  # threshold 0.12
    assert out.tolist() == [[0.0, 0.40, 0.25, 0.15, 0.0, 0.0]]


def test_target_probs_applies_temperature_first() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    sampling = SamplingSettings(temperature=0.5, top_k=2, top_p=1.0, min_p=0.0, vocab_size=3)
    probs = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(target_probs(logits, sampling), probs * torch.tensor([0.0, 1.0, 1.0]))
    plain = dataclasses.replace(sampling, top_k=3)
    assert torch.allclose(target_probs(logits, plain), probs)


# Three tokens tie at the top-k cut-off (BF16 logits take few distinct values): which of
# them a sampler keeps is its own order's choice.
TIED = torch.tensor([[0.30, 0.15, 0.25, 0.15, 0.15, 0.00]], dtype=torch.float64)


def test_ties_at_a_cut_off_fall_as_a_sort_orders_them() -> None:
    assert filter_probs(TIED.clone(), 3, 1.0, 0.0).tolist() == [[0.30, 0.15, 0.25, 0.0, 0.0, 0.0]]


def test_a_drawn_token_tied_at_the_cut_off_is_kept_in_the_place_of_an_equal() -> None:
    """Upstream's torch sampler keeps the batch's top-k by ``torch.topk``, which orders
    equal probabilities unlike a sort: it may draw token 4 where a sort keeps token 1.
    The draft keeps the drawn token; the kept mass, and so its probability, are as
    upstream drew it."""
    sampling = SamplingSettings(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, vocab_size=VOCAB)
    for token in (1, 3, 4):
        q = draft_probs(TIED[0].clone(), sampling, token)
        assert q[token] == 0.15 and q[0] == 0.30 and q[2] == 0.25
        assert sorted(q[q > 0].tolist()) == [0.15, 0.25, 0.30]
        assert held_tokens_problem([token], [q], VOCAB) is None
    # a token that ties nothing kept is not kept: the rule names it
    q = draft_probs(TIED[0].clone(), sampling, 5)
    problem = held_tokens_problem([5], [q], VOCAB)
    assert problem == "held token 0 (5) has no probability under its own draft distribution"


def test_a_drawn_token_tied_at_a_top_p_cut_off_is_kept() -> None:
    # mass above each in sort order: 0, 0.30, 0.55 (token 1), 0.70 (3), 0.85 (4): top-p 0.6
    # keeps the first tie only
    sampling = SamplingSettings(temperature=1.0, top_k=VOCAB, top_p=0.6, min_p=0.0, vocab_size=VOCAB)
    assert filter_probs(TIED.clone(), VOCAB, 0.6, 0.0)[0].tolist() == [0.30, 0.15, 0.25, 0.0, 0.0, 0.0]
    q = draft_probs(TIED[0].clone(), sampling, 4)
    assert q.tolist() == [0.30, 0.0, 0.25, 0.0, 0.15, 0.0]


def test_the_draft_of_every_token_upstreams_topk_keeps_holds_it() -> None:
    """What broke a TP 2 e2e run: BF16-valued logits, top-k 20 over 32k tokens; about a
    quarter of such rows keep another set by ``torch.topk`` than by a sort. Every token
    the topk keeps must have its draft probability there, and the kept mass must be the
    topk's (the same probabilities)."""
    gen = torch.Generator().manual_seed(3)
    sampling = SamplingSettings(temperature=0.8, top_k=20, top_p=1.0, min_p=0.0, vocab_size=32_000)
    differing = 0
    for _ in range(40):
        logits = (torch.randn(1, 32_000, generator=gen) * 2).bfloat16().float()
        tempered = tempered_probs(logits, sampling)[0]
        values, kept = torch.topk(tempered, 20)
        sorted_kept = torch.nonzero(target_probs(logits, sampling)[0]).flatten()
        differing += set(kept.tolist()) != set(sorted_kept.tolist())
        for token in kept.tolist():
            q = draft_probs(tempered, sampling, token)
            assert q[token] == tempered[token]
            assert torch.equal(q[q > 0].sort().values, values.sort().values)
    assert differing > 0  # the case this test is about occurred


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs / probs.sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the filtered support was committed"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_the_rule_on_filtered_distributions_commits_the_filtered_target() -> None:
    """Draft from filtered q, verify against filtered p (top-p 0.8 on both): the first
    committed token follows filtered p, never a token top-p excluded. 10k trials, 3
    degrees of freedom: the 99.9% quantile is 16.3."""
    gen = torch.Generator().manual_seed(99)
    q = filter_probs(
        torch.tensor([[0.30, 0.05, 0.30, 0.05, 0.25, 0.05]], dtype=torch.float64), VOCAB, 0.8, 0.0
    )
    p = filter_probs(P.clone(), VOCAB, 0.8, 0.0)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(10_000):
        held = torch.multinomial(q, 1, generator=gen).squeeze(1)
        counts[verify_sampling(held, q, p, generator=gen).tokens[0]] += 1
    assert _chi_square(counts, p[0]) < 16.3
