"""The TP ranks' agreement (lynx.verify.agreement), with the MIN reduction played by a
function over the ranks' vectors."""

from __future__ import annotations

import pytest

from lynx.transfer import Verdict
from lynx.verify import RankDivergenceError, ReduceMin, agree

ROOMS = [(1 << 62) + 5, 17, (1 << 40) + 3]


def ranks(*others: list[int]) -> ReduceMin:
    """The reduction as seen by one rank, the others' vectors given."""

    def reduce_min(mine: list[int]) -> list[int]:
        return [min(column) for column in zip(mine, *others, strict=True)]

    return reduce_min


def vector(windows: list[int], verdicts: list[Verdict], rooms: list[int] = ROOMS) -> list[int]:
    """Another rank's local vector, through agree() with the identity reduction."""
    captured: list[list[int]] = []

    def capture(values: list[int]) -> list[int]:
        captured.append(values)
        return values

    agree(rooms, windows, verdicts, capture)
    return captured[0]


def test_one_rank_passes_its_own_values_through() -> None:
    verdicts = [Verdict.READY, Verdict.WAIT, Verdict.FAIL]
    agreement = agree(ROOMS, [4, 32, 7], verdicts, None)
    assert agreement.windows == [4, 32, 7]
    assert agreement.verdicts == verdicts
    assert agreement.others_failed == [False, False, False]
    assert agree([], [], [], None).verdicts == []


def test_ranks_agree_on_the_smallest_window_and_the_least_ready_verdict() -> None:
    mine = [Verdict.READY, Verdict.READY, Verdict.WAIT]
    theirs = vector([8, 0, 32], [Verdict.WAIT, Verdict.FAIL, Verdict.READY])
    agreement = agree(ROOMS, [32, 32, 5], mine, ranks(theirs))
    assert agreement.windows == [8, 0, 5]  # 0: another rank expects its Residual before a draft pays
    # READY only where every rank refined; FAIL wherever any rank failed
    assert agreement.verdicts == [Verdict.WAIT, Verdict.FAIL, Verdict.WAIT]
    assert agreement.others_failed == [False, True, False]


def test_a_request_failed_here_is_not_reported_as_failed_elsewhere() -> None:
    theirs = vector([1, 1, 1], [Verdict.FAIL, Verdict.READY, Verdict.READY])
    agreement = agree(ROOMS, [1, 1, 1], [Verdict.FAIL, Verdict.READY, Verdict.READY], ranks(theirs))
    assert agreement.verdicts == [Verdict.FAIL, Verdict.READY, Verdict.READY]
    assert agreement.others_failed == [False, False, False]


def test_ranks_tracking_other_requests_are_a_divergence() -> None:
    swapped = vector([1, 1, 1], [Verdict.WAIT] * 3, [ROOMS[1], ROOMS[0], ROOMS[2]])
    with pytest.raises(RankDivergenceError, match="track different speculative requests"):
        agree(ROOMS, [1, 1, 1], [Verdict.WAIT] * 3, ranks(swapped))
    with pytest.raises(RankDivergenceError, match="returned 3 values for 12"):
        agree(ROOMS, [1, 1, 1], [Verdict.WAIT] * 3, lambda values: values[:3])


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="2 windows and 3 verdicts for 3 rooms"):
        agree(ROOMS, [1, 1], [Verdict.WAIT] * 3, None)
    with pytest.raises(ValueError, match=">= 0"):
        agree(ROOMS, [-1, 1, 1], [Verdict.WAIT] * 3, None)


def test_values_fit_the_int32_reduction() -> None:
    values = vector([32, 32, 32], [Verdict.READY] * 3)
    assert all(-(1 << 31) < v < 1 << 31 for v in values)
