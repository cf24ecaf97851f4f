"""The logprobs of committed tokens, rebuilt from the verify pass (``lynx.verify.logprobs``)."""

from __future__ import annotations

import math

import pytest
import torch

from lynx.verify import CommittedLogprobs, LogprobRequest, committed_logprobs

VOCAB = 6


def rows() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(4, VOCAB) * 3


def test_token_logprobs_are_the_log_softmax_at_the_request_temperature() -> None:
    logits = rows()
    out = committed_logprobs(logits, [2, 5, 0], LogprobRequest(temperature=0.5))
    expected = torch.log_softmax(logits[:3] / 0.5, dim=-1)
    assert out.token_idx == [2, 5, 0]
    assert out.token_val == pytest.approx([float(expected[i, t]) for i, t in enumerate([2, 5, 0])])
    assert out.top_val == out.top_idx == out.ids_val == out.ids_idx == []  # not asked for


def test_top_logprobs_and_token_id_logprobs_per_position() -> None:
    logits = rows()
    out = committed_logprobs(logits, [1, 3], LogprobRequest(top_n=2, token_ids=(4, 0)))
    expected = torch.log_softmax(logits[:2], dim=-1)
    for i in range(2):
        best = expected[i].topk(2)
        assert out.top_idx[i] == best.indices.tolist()
        assert out.top_val[i] == pytest.approx(best.values.tolist())
        assert out.ids_idx[i] == [4, 0]
        assert out.ids_val[i] == pytest.approx([float(expected[i, 4]), float(expected[i, 0])])


def test_an_impossible_token_gets_the_lowest_finite_value_not_minus_infinity() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = -math.inf
    out = committed_logprobs(logits, [3], LogprobRequest())
    assert out.token_val == [torch.finfo(torch.float32).min]


def test_nothing_committed_gives_empty_lists() -> None:
    assert committed_logprobs(torch.zeros(0, VOCAB), [], LogprobRequest(top_n=3)) == CommittedLogprobs()


def test_too_few_rows_or_a_zero_temperature_raise() -> None:
    with pytest.raises(ValueError, match="3 committed tokens"):
        committed_logprobs(torch.zeros(2, VOCAB), [1, 2, 3], LogprobRequest())
    with pytest.raises(ValueError, match="positive temperature"):
        committed_logprobs(torch.zeros(2, VOCAB), [1], LogprobRequest(temperature=0.0))


def test_token_ids_outside_the_vocabulary_raise_a_value_error() -> None:
    with pytest.raises(ValueError, match="token id 6 is outside the vocabulary of 6"):
        committed_logprobs(rows(), [1], LogprobRequest(token_ids=(2, 6)))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        committed_logprobs(rows(), [-1], LogprobRequest())
