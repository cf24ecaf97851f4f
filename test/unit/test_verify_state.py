"""The speculative request state machine and its held-token bookkeeping."""

from __future__ import annotations

import pytest
import torch

from lynx.verify.state import SPEC_TRANSITIONS, HeldTokens, ParkReason, SpecState

S = SpecState


def test_the_machine_is_pinned() -> None:
    assert {
        S.SPECULATIVE: {S.PARKED, S.VERIFYING, S.FAILED},
        S.PARKED: {S.VERIFYING, S.FAILED},
        S.VERIFYING: {S.COMMITTED, S.FAILED},
        S.COMMITTED: set(),
        S.FAILED: set(),
    } == SPEC_TRANSITIONS


@pytest.mark.parametrize(
    ("start", "to"),
    [(a, b) for a in SpecState for b in SpecState if b not in SPEC_TRANSITIONS[a]],
)
def test_illegal_moves_raise(start: SpecState, to: SpecState) -> None:
    held = HeldTokens(cap=4, state=start)
    with pytest.raises(ValueError, match="not allowed"):
        held.move(to)


def test_the_cap_parks() -> None:
    held = HeldTokens(cap=3)
    for token in (5, 6):
        held.hold(token)
    assert held.state is S.SPECULATIVE
    held.hold(7)
    assert (held.state, held.park_reason, held.tokens) == (S.PARKED, ParkReason.CAP, [5, 6, 7])
    with pytest.raises(ValueError, match="cannot hold"):
        held.hold(8)


def test_a_held_token_that_would_finish_the_request_parks_it_even_at_the_cap() -> None:
    held = HeldTokens(cap=3)
    held.hold(5, finishes=True)
    assert (held.state, held.park_reason, held.tokens) == (S.PARKED, ParkReason.FINISH, [5])
    at_cap = HeldTokens(cap=2)
    at_cap.hold(5)
    at_cap.hold(6, finishes=True)  # fills the cap and finishes it: the finish is what to say
    assert at_cap.park_reason is ParkReason.FINISH


def test_commit_keeps_the_accepted_prefix_and_its_probabilities() -> None:
    held = HeldTokens(cap=8, draft_probs=[])
    for token in range(4):
        held.hold(token, probs=torch.full((3,), float(token)))
    held.park(ParkReason.FINISH)
    held.verifying()
    assert held.committed(accepted=2) == [2, 3]
    assert held.draft_probs is not None
    assert held.tokens == [0, 1] and [float(p[0]) for p in held.draft_probs] == [0.0, 1.0]
    assert held.state is S.COMMITTED


def test_sampled_and_greedy_requests_are_not_mixed() -> None:
    with pytest.raises(ValueError, match="draft distribution"):
        HeldTokens(cap=8).hold(1, probs=torch.ones(3))
    with pytest.raises(ValueError, match="draft distribution"):
        HeldTokens(cap=8, draft_probs=[]).hold(1)


def test_residual_before_the_cap_verifies_directly() -> None:
    held = HeldTokens(cap=8)
    held.hold(1)
    held.verifying()
    assert held.committed(accepted=1) == []
    with pytest.raises(ValueError, match="accepted 3 of 1"):
        HeldTokens(cap=8, state=S.VERIFYING, tokens=[1]).committed(accepted=3)


def test_cap_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        HeldTokens(cap=-1)
    assert HeldTokens(cap=0).state is S.SPECULATIVE  # the decoder parks it before it decodes


def test_one_late_token_after_the_park() -> None:
    """The overlap scheduler launched the next step before the request parked."""
    held = HeldTokens(cap=2)
    with pytest.raises(ValueError, match="late token arrives once, after the park"):
        held.hold_late(9)
    held.hold(1)
    held.hold(2)
    assert held.state is SpecState.PARKED
    held.hold_late(3)
    assert held.tokens == [1, 2, 3] and held.late and held.state is SpecState.PARKED
    with pytest.raises(ValueError, match="late token arrives once"):
        held.hold_late(4)
    sampled = HeldTokens(cap=1, draft_probs=[])
    sampled.hold(1, torch.ones(4) / 4)
    with pytest.raises(ValueError, match="draft distribution"):
        sampled.hold_late(2)
    sampled.hold_late(2, torch.ones(4) / 4)
    assert sampled.draft_probs is not None and len(sampled.draft_probs) == 2
