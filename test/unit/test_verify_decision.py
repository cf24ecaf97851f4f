"""The per-request decisions of speculative mode (``lynx.verify.decision``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lynx.verify import (
    LogprobRequest,
    ParkReason,
    SamplingSettings,
    SpeculationStats,
    acceptance_draws,
    bf16_ulp,
    decide,
    held_tokens_problem,
    report,
    row_rejects,
    unverifiable_because,
)

VOCAB = 8
GREEDY = SamplingSettings(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0, vocab_size=VOCAB)
SAMPLED = dataclasses.replace(GREEDY, top_k=VOCAB, temperature=0.7)


def logits_choosing(*tokens: int) -> torch.Tensor:
    rows = torch.zeros(len(tokens), VOCAB)
    for i, token in enumerate(tokens):
        rows[i, token] = 5.0
    return rows


def test_greedy_keeps_the_matching_prefix_and_corrects_the_first_miss() -> None:
    decision = decide([3, 4, 5, 6], logits_choosing(3, 4, 1, 6), GREEDY)
    assert (decision.held, decision.accepted, decision.correction) == (4, 2, 1)
    assert decision.rejected
    assert decision.agreed == 3  # teacher-forced: position 3 agrees again


def test_greedy_all_accepted_commits_no_correction() -> None:
    decision = decide([3, 4], logits_choosing(3, 4), GREEDY)
    assert (decision.accepted, decision.correction, decision.rejected, decision.agreed) == (2, None, False, 2)


def test_nothing_held_decides_nothing() -> None:
    decision = decide([], None, GREEDY)
    assert (decision.held, decision.accepted, decision.correction, decision.agreed) == (0, 0, None, None)
    with pytest.raises(ValueError, match="no verify logits"):
        decide([1], None, GREEDY)


def test_sampled_requests_follow_the_speculative_sampling_rule() -> None:
    # Draft and target agree exactly: every held token is accepted, whatever the coin says.
    logits = logits_choosing(2, 5)
    probs = list(torch.softmax(logits / SAMPLED.temperature, dim=-1))
    decision = decide([2, 5], logits, SAMPLED, draft_probs=probs, generator=torch.Generator().manual_seed(0))
    assert (decision.accepted, decision.correction, decision.agreed) == (2, None, None)
    # The draft put all its mass on a token the target never picks: rejected, corrected.
    draft = torch.zeros(VOCAB)
    draft[7] = 1.0
    target = torch.full((1, VOCAB), -1e4)
    target[0, 4] = 0.0
    decision = decide([7], target, SAMPLED, draft_probs=[draft], generator=torch.Generator().manual_seed(0))
    assert (decision.accepted, decision.correction) == (0, 4)


def test_sampled_requests_need_every_draft_distribution() -> None:
    with pytest.raises(ValueError, match="draft distribution of every held token"):
        decide([2, 5], logits_choosing(2, 5), SAMPLED, draft_probs=[torch.ones(VOCAB)])


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"top_k": VOCAB, "temperature": 0.8}, None),  # plain temperature sampling speculates
        ({"top_k": 4, "temperature": 0.8}, None),  # filtered sampling speculates too
        ({"top_p": 0.9, "top_k": VOCAB}, None),
        ({"min_p": 0.1, "top_k": VOCAB}, None),
        ({"logprobs": LogprobRequest(top_n=2)}, None),  # rebuilt from the verify pass
        ({"grammar": True}, "a grammar"),
        ({"penalties": True}, "penalties"),
        ({"min_new_tokens": True}, "min_new_tokens"),
        ({"logit_bias": True}, "logit_bias"),
        ({"custom_logit_processor": True}, "a custom logit processor"),
        ({"hidden_states": True}, "hidden states"),
        ({"watermark": True}, "a watermark"),
    ],
)
def test_what_waits_for_the_residual(change: dict, reason: str | None) -> None:
    assert unverifiable_because(dataclasses.replace(GREEDY, **change)) == reason


def test_the_report_carries_the_decision() -> None:
    decision = decide([3, 4, 5], logits_choosing(3, 0, 5), GREEDY)
    out = report(decision, window=8, park_reason=ParkReason.CAP, anchor_to_commit_s=1.5, verify_s=0.25)
    assert dataclasses.asdict(out) == {
        "held": 3,
        "window": 8,
        "accepted": 1,
        "agreed": 2,
        "rejected": True,
        "rejection_gap": pytest.approx(5.0),
        "park_reason": ParkReason.CAP.value,
        "anchor_to_commit_s": 1.5,
        "verify_s": 0.25,
        "refine_s": 0.0,
        "verified": 3,
        "rejection_gap_ulps": pytest.approx(5.0 / 0.03125),  # the best logit 5.0: ulp 2**-5
        "verified_ahead_layers": 0,
        "verify_ahead_s": 0.0,
    }
    nothing = report(
        decide([], None, GREEDY), window=8, park_reason=None, anchor_to_commit_s=0.0, verify_s=0.0
    )
    assert nothing.park_reason is None and nothing.rejection_gap is None


def test_tolerance_accepts_a_near_tie_and_still_corrects_to_the_argmax() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[0, 3], logits[0, 2] = 2.0, 1.96  # held token 2 is 0.04 below the best
    logits[1, 5] = 4.0
    strict = decide([2, 5], logits, GREEDY)
    assert (strict.accepted, strict.correction) == (0, 3)
    assert strict.rejection_gap == pytest.approx(0.04, abs=1e-6)
    just_inside = decide([2, 5], logits, GREEDY, tolerance=0.0401)
    assert (just_inside.accepted, just_inside.correction, just_inside.rejection_gap) == (2, None, None)
    just_outside = decide([2, 5], logits, GREEDY, tolerance=0.0399)
    assert (just_outside.accepted, just_outside.correction) == (0, 3)


def test_strict_mode_breaks_exact_ties_as_argmax_does() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 1] = logits[0, 6] = 3.0  # argmax picks 1
    tied = decide([6], logits, GREEDY)
    assert (tied.accepted, tied.correction, tied.rejection_gap) == (0, 1, 0.0)
    assert decide([6], logits, GREEDY, tolerance=1e-9).accepted == 1


def test_held_tokens_problem_names_what_cannot_be_verified() -> None:
    uniform = torch.full((4,), 0.25)
    assert held_tokens_problem([1, 3], None, 4) is None
    assert held_tokens_problem([1, 3], [uniform, uniform], 4) is None
    assert "outside the vocabulary of 4" in str(held_tokens_problem([1, 4], None, 4))
    assert "outside the vocabulary" in str(held_tokens_problem([-1], None, 4))
    assert "2 held tokens" in str(held_tokens_problem([1, 3], [uniform], 4))
    nan = torch.tensor([0.5, float("nan"), 0.25, 0.25])
    assert "not finite" in str(held_tokens_problem([1], [nan], 4))
    assert "no probability" in str(held_tokens_problem([1], [torch.tensor([1.0, 0.0, 0.0, 0.0])], 4))
    assert "shape" in str(held_tokens_problem([1], [torch.full((5,), 0.2)], 4))


def test_per_token_outputs_are_unverifiable() -> None:
    settings = SamplingSettings(1.0, 1, 1.0, 0.0, 8, per_token_outputs=True)
    assert "per-token outputs" in str(unverifiable_because(settings))


def _judged_row_by_row(held: list[int], logits: torch.Tensor, sampling: SamplingSettings, **rule) -> int:
    """How many rows a verify pass computes when it stops at :func:`row_rejects`."""
    for i in range(len(held)):
        if row_rejects(i, logits[i], held, sampling, **rule):
            return i + 1
    return len(held)


def test_a_greedy_verify_pass_stops_at_the_first_rejection_and_decides_the_same() -> None:
    held = [3, 4, 5, 6]
    logits = logits_choosing(3, 4, 1, 6)  # row 2 rejects; row 3 would agree again
    rows = _judged_row_by_row(held, logits, GREEDY)
    assert rows == 3
    whole, stopped = decide(held, logits, GREEDY), decide(held, logits[:rows], GREEDY)
    assert (stopped.held, stopped.accepted, stopped.correction) == (
        whole.held,
        whole.accepted,
        whole.correction,
    )
    assert stopped.committed(held) == whole.committed(held) == [3, 4, 1]
    # agreement counts the rows computed: the unjudged tail is unknown, not wrong
    assert (stopped.verified, stopped.agreed, whole.verified, whole.agreed) == (3, 2, 4, 3)
    # with a tolerance, each row judges as the whole decision does
    near = torch.zeros(2, VOCAB)
    near[0, 3], near[0, 2], near[1, 5] = 2.0, 1.96, 4.0
    assert _judged_row_by_row([2, 5], near, GREEDY) == 1
    assert _judged_row_by_row([2, 5], near, GREEDY, tolerance=0.0401) == 2


def test_a_sampled_verify_pass_stops_where_its_draws_reject_and_decides_the_same() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    held = [int(t) for t in torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(2))]
    drafts = list(torch.softmax(torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)), -1))
    for seed in range(20):
        draws = acceptance_draws(held, SAMPLED, torch.Generator().manual_seed(seed))
        assert draws is not None and draws.shape == (6,)
        rows = _judged_row_by_row(held, logits, SAMPLED, draft_probs=drafts, draws=draws)
        whole = decide(
            held, logits, SAMPLED, draft_probs=drafts, draws=draws, generator=torch.Generator().manual_seed(9)
        )
        stopped = decide(
            held,
            logits[:rows],
            SAMPLED,
            draft_probs=drafts,
            draws=draws,
            generator=torch.Generator().manual_seed(9),
        )
        assert (stopped.accepted, stopped.correction) == (whole.accepted, whole.correction), seed
        assert rows == (whole.accepted + 1 if whole.rejected else len(held))
    assert acceptance_draws(held, GREEDY, None) is None


def test_rows_that_stopped_without_a_rejection_commit_what_they_verified() -> None:
    """Should a stopped pass's rows all accept after all (the stop and the decision are
    the same rule, so only a bug could), the verified prefix is committed with no
    correction and decoding continues from it: never a token the rows did not check."""
    decision = decide([3, 4, 5], logits_choosing(3, 4), GREEDY)
    assert (decision.held, decision.accepted, decision.correction, decision.verified) == (3, 2, None, 2)
    assert decision.committed([3, 4, 5]) == [3, 4]


def test_a_sampled_row_needs_its_draft_and_draw() -> None:
    with pytest.raises(ValueError, match="draft distributions and acceptance draws"):
        row_rejects(0, logits_choosing(2)[0], [2], SAMPLED)


@pytest.mark.parametrize(
    ("best", "gap", "ulps", "counted_as"),
    [
        (3.0, 0.0, 0.0, "tied"),
        (20.0, 0.125, 1.0, "near_tie"),  # one ulp at 16-32: the smallest gap BF16 logits show
        (5.0, 0.03125, 1.0, "near_tie"),  # one ulp at 4-8 is 1/32
        (5.0, 0.125, 4.0, "far"),  # the same 0.125 is 4 ulps there
        (20.0, 0.5, 4.0, "far"),
    ],
)
def test_rejections_are_judged_in_bf16_ulps_of_the_best_logit(
    best: float, gap: float, ulps: float, counted_as: str
) -> None:
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 1], logits[0, 6] = best, best - gap  # held token 6, the argmax 1
    decision = decide([6], logits, GREEDY)
    assert decision.rejection_gap == pytest.approx(gap) and decision.rejection_gap_ulps == pytest.approx(ulps)
    stats = SpeculationStats()
    stats.record(report(decision, window=4, park_reason=None, anchor_to_commit_s=0.0, verify_s=0.0))
    counts = {
        "tied": stats.rejections_tied,
        "near_tie": stats.rejections_near_tie,
        "far": stats.rejections_far,
    }
    assert counts == {name: int(name == counted_as) for name in counts}


def test_bf16_ulp_is_the_gap_to_the_next_bf16_number() -> None:
    for value in (0.3, 1.0, 5.0, 17.5, -20.0, 300.0, 1e-30):
        x = torch.tensor(abs(value), dtype=torch.bfloat16)
        following = (x.view(torch.int16) + 1).view(torch.bfloat16)  # the next BF16 number up
        assert bf16_ulp(value) == float(following.float() - x.float()), value
    assert bf16_ulp(0.0) > 0 and bf16_ulp(float("nan")) > 0
