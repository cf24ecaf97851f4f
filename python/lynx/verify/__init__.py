"""Verification of tokens decoded on Anchor KV against full-precision KV.

:mod:`lynx.verify.acceptance`: the greedy and speculative-sampling acceptance rules.
"""

from lynx.verify.acceptance import VerifyOutcome, verify_greedy, verify_sampling

__all__ = ["VerifyOutcome", "verify_greedy", "verify_sampling"]
