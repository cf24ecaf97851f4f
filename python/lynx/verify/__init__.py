"""Verification of tokens decoded on Anchor KV against full-precision KV.

:mod:`lynx.verify.acceptance`: the greedy and speculative-sampling acceptance rules;
:mod:`lynx.verify.decision`: may a request speculate, what its verify pass commits, its report;
:mod:`lynx.verify.state`: a speculative request's state machine and held tokens;
:mod:`lynx.verify.rollback`: which KV slots a commit keeps and frees;
:mod:`lynx.verify.stats`: what speculation did, per request and per server.
"""

from lynx.verify.acceptance import VerifyOutcome, greedy_agreement, verify_greedy, verify_sampling
from lynx.verify.decision import SamplingSettings, VerifyDecision, decide, report, unverifiable_because
from lynx.verify.rollback import KVCommit, kv_after_commit
from lynx.verify.state import SPEC_TRANSITIONS, HeldTokens, ParkReason, SpecState
from lynx.verify.stats import SpeculationReport, SpeculationStats

__all__ = [
    "SPEC_TRANSITIONS",
    "HeldTokens",
    "KVCommit",
    "ParkReason",
    "SamplingSettings",
    "SpecState",
    "SpeculationReport",
    "SpeculationStats",
    "VerifyDecision",
    "VerifyOutcome",
    "decide",
    "greedy_agreement",
    "kv_after_commit",
    "report",
    "unverifiable_because",
    "verify_greedy",
    "verify_sampling",
]
