"""Verification of tokens decoded on Anchor KV against full-precision KV.

:mod:`lynx.verify.acceptance`: the greedy and speculative-sampling acceptance rules;
:mod:`lynx.verify.sampling`: the distribution a sampled token is drawn from, rebuilt from logits;
:mod:`lynx.verify.logprobs`: the logprobs a request asked for, rebuilt for its committed tokens;
:mod:`lynx.verify.decision`: may a request speculate, what its verify pass commits, its report;
:mod:`lynx.verify.state`: a speculative request's state machine and held tokens;
:mod:`lynx.verify.rollback`: which KV slots a commit keeps and frees;
:mod:`lynx.verify.window`: how many tokens a request holds before its Residual lands;
:mod:`lynx.verify.stats`: what speculation did, per request and per server;
:mod:`lynx.verify.agreement`: what a decode server's TP ranks agree on before they act.
"""

from lynx.verify.acceptance import (
    VerifyOutcome,
    bf16_ulp,
    greedy_agreement,
    greedy_rejections,
    log_prob_gaps,
    sampling_rejections,
    verify_greedy,
    verify_sampling,
)
from lynx.verify.agreement import RankAgreement, RankDivergenceError, ReduceMin, agree
from lynx.verify.decision import (
    VerifyDecision,
    acceptance_draws,
    decide,
    held_tokens_problem,
    report,
    row_rejects,
    unverifiable_because,
)
from lynx.verify.logprobs import CommittedLogprobs, LogprobRequest, committed_logprobs
from lynx.verify.rollback import KVCommit, kv_after_commit
from lynx.verify.sampling import SamplingSettings, draft_probs, filter_probs, target_probs, tempered_probs
from lynx.verify.state import SPEC_TRANSITIONS, HeldTokens, ParkReason, SpecState
from lynx.verify.stats import NEAR_TIE_GAP, NEAR_TIE_ULPS, SpeculationReport, SpeculationStats
from lynx.verify.window import VerifyPass, WindowEstimator, speculation_window

__all__ = [
    "NEAR_TIE_GAP",
    "NEAR_TIE_ULPS",
    "SPEC_TRANSITIONS",
    "CommittedLogprobs",
    "HeldTokens",
    "KVCommit",
    "LogprobRequest",
    "ParkReason",
    "RankAgreement",
    "RankDivergenceError",
    "ReduceMin",
    "SamplingSettings",
    "SpecState",
    "SpeculationReport",
    "SpeculationStats",
    "VerifyDecision",
    "VerifyOutcome",
    "VerifyPass",
    "WindowEstimator",
    "acceptance_draws",
    "agree",
    "bf16_ulp",
    "committed_logprobs",
    "decide",
    "draft_probs",
    "filter_probs",
    "greedy_agreement",
    "greedy_rejections",
    "held_tokens_problem",
    "kv_after_commit",
    "log_prob_gaps",
    "report",
    "row_rejects",
    "sampling_rejections",
    "speculation_window",
    "target_probs",
    "tempered_probs",
    "unverifiable_because",
    "verify_greedy",
    "verify_sampling",
]
