"""The sampled distribution rebuilt from logits (``lynx.verify.sampling``), and the
speculative-sampling rule on filtered distributions."""

from __future__ import annotations

import dataclasses

import torch

from lynx.verify import SamplingSettings, filter_probs, target_probs, verify_sampling

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
