"""The acceptance rules: greedy prefix + correction, and speculative sampling, whose
committed tokens must be distributed exactly as full-precision sampling."""

from __future__ import annotations

import pytest
import torch

from lynx.verify import VerifyOutcome, greedy_agreement, verify_greedy, verify_sampling

VOCAB = 6


def logits_with_argmax(tokens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(tokens), VOCAB)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


@pytest.mark.parametrize(
    ("held", "full_argmax", "accepted", "tokens"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all match: the bonus token follows
        ([1, 2, 3], [1, 5, 3, 4], 1, [1, 5]),  # first mismatch at 2: correction 5
        ([1, 2, 3], [0, 2, 3, 4], 0, [0]),  # the very first held token is wrong
        ([], [4], 0, [4]),  # nothing held: just the next token
    ],
)
def test_greedy(held: list[int], full_argmax: list[int], accepted: int, tokens: list[int]) -> None:
    outcome = verify_greedy(torch.tensor(held, dtype=torch.int64), logits_with_argmax(full_argmax))
    assert outcome == VerifyOutcome(held=len(held), accepted=accepted, tokens=tokens)
    assert outcome.rejected == (accepted < len(held))


@pytest.mark.parametrize(
    ("held", "full_argmax", "accepted", "tokens"),
    [
        ([1, 2, 3], [1, 2, 3], 3, [1, 2, 3]),  # all match, no bonus row: commit the held ones
        ([1, 2, 3], [1, 5, 3], 1, [1, 5]),
        ([1, 2, 3], [0, 2, 3], 0, [0]),
    ],
)
def test_greedy_without_the_bonus_row(
    held: list[int], full_argmax: list[int], accepted: int, tokens: list[int]
) -> None:
    outcome = verify_greedy(torch.tensor(held, dtype=torch.int64), logits_with_argmax(full_argmax))
    assert outcome == VerifyOutcome(held=len(held), accepted=accepted, tokens=tokens)


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="need 2 or 3"):
        verify_greedy(torch.tensor([1, 2]), torch.zeros(1, VOCAB))
    with pytest.raises(ValueError, match="need 0 or 1"):
        verify_greedy(torch.tensor([], dtype=torch.int64), torch.zeros(0, VOCAB))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_greedy(torch.tensor([VOCAB]), torch.zeros(2, VOCAB))
    with pytest.raises(ValueError, match="1-D integer"):
        verify_greedy(torch.tensor([1.0]), torch.zeros(2, VOCAB))
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_sampling(torch.tensor([1]), torch.ones(3, VOCAB), torch.ones(2, VOCAB))
    with pytest.raises(ValueError, match="finite and non-negative"):
        verify_sampling(torch.tensor([1]), -torch.ones(1, VOCAB), torch.ones(2, VOCAB))
    with pytest.raises(ValueError, match="zero probability"):
        q = torch.ones(1, VOCAB)
        q[0, 1] = 0
        verify_sampling(torch.tensor([1]), q, torch.ones(2, VOCAB))


def test_identical_distributions_accept_everything() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, VOCAB, generator=gen), -1)
    for _ in range(200):
        held = torch.multinomial(p[:3], 1, generator=gen).squeeze(1)
        outcome = verify_sampling(held, p[:3], p, generator=gen)
        assert outcome.accepted == 3 and outcome.tokens[:3] == held.tolist()
        assert len(outcome.tokens) == 4  # the bonus token
        without_bonus = verify_sampling(held, p[:3], p[:3], generator=gen)
        assert without_bonus.accepted == 3 and without_bonus.tokens == held.tolist()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampling_rule_reproduces_the_full_precision_distribution() -> None:
    """Draft from q (the Anchor's distribution), verify against p: the first committed
    token must be distributed as p_1, whatever q is. 10k trials, chi-square with 5
    degrees of freedom: the 99.9% quantile is 20.5; a rule that skipped the residual
    resampling (committing the draft or argmax p) lands in the thousands."""
    gen = torch.Generator().manual_seed(1234)
    p = torch.tensor(
        [
            [0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
            [0.10, 0.10, 0.20, 0.20, 0.20, 0.20],
            [1 / 6] * 6,
        ],
        dtype=torch.float64,
    )
    q = torch.tensor(
        [[0.10, 0.10, 0.30, 0.30, 0.10, 0.10], [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]],
        dtype=torch.float64,
    )
    trials = 10_000
    first = torch.zeros(VOCAB, dtype=torch.float64)
    second = torch.zeros(VOCAB, dtype=torch.float64)
    accepted_first = 0
    for _ in range(trials):
        held = torch.multinomial(q, 1, generator=gen).squeeze(1)
        outcome = verify_sampling(held, q, p, generator=gen)
        first[outcome.tokens[0]] += 1
        accepted_first += outcome.accepted >= 1
        if len(outcome.tokens) >= 2:  # the first token was accepted
            second[outcome.tokens[1]] += 1
    assert _chi_square(first, p[0]) < 20.5
    assert _chi_square(second, p[1]) < 20.5
    # P(accept) = sum_x min(p, q) for the first draft
    expected_accept = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted_first / trials - expected_accept) < 0.015


def test_a_wrong_rule_is_caught_by_the_same_statistic() -> None:
    """The check above can fail: committing the draft unverified is far off p."""
    gen = torch.Generator().manual_seed(7)
    p0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04], dtype=torch.float64)
    q0 = torch.tensor([0.10, 0.10, 0.30, 0.30, 0.10, 0.10], dtype=torch.float64)
    counts = torch.bincount(torch.multinomial(q0, 10_000, replacement=True, generator=gen), minlength=VOCAB)
    assert _chi_square(counts.double(), p0) > 500


def test_greedy_agreement_counts_every_matching_position() -> None:
    held = torch.tensor([1, 2, 3, 4])
    # the second held token is wrong; the later ones agree with full precision anyway
    assert greedy_agreement(held, logits_with_argmax([1, 5, 3, 4])) == 3
    assert (
        greedy_agreement(held, logits_with_argmax([1, 5, 3, 4, 0])) == 3
    )  # the bonus row is not a held token
    assert verify_greedy(held, logits_with_argmax([1, 5, 3, 4])).accepted == 1
