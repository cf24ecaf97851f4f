"""The life of a request in speculative mode, on the decode server.

::

    (Anchor landed)                      (Residual landed)
    SPECULATIVE --cap / held finish--> PARKED --+
        |                                        +--> VERIFYING --> COMMITTED
        +----------- Residual landed ------------+          \\
    any state --abort / transfer failure--> FAILED           +--> (rollback, then COMMITTED)

* ``SPECULATIVE``: decoding on Anchor KV in normal batches; its tokens are held (the
  first token, from prefill, is exact and is released at once).
* ``PARKED``: out of the batch, waiting for the Residual: it holds ``cap`` tokens, or a
  held token would finish it (EOS, stop string, max_new_tokens), which only counts after
  verification. Under the overlap scheduler the request's next step was launched before
  it parked; that step's token, the *late* token, is held too (at most one per request).
* ``VERIFYING``: the prompt KV is refined; one forward over the held tokens is queued or
  running.
* ``COMMITTED``: the accepted prefix plus the correction are the request's tokens; it
  decodes on as a plain request. A request whose Residual lands before it was admitted
  goes straight here (no speculation).

``SPEC_TRANSITIONS`` is the whole machine (pinned by ``test/unit/test_verify_state.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class SpecState(enum.Enum):
    SPECULATIVE = "speculative"
    PARKED = "parked"
    VERIFYING = "verifying"
    COMMITTED = "committed"
    FAILED = "failed"


SPEC_TRANSITIONS: dict[SpecState, frozenset[SpecState]] = {
    SpecState.SPECULATIVE: frozenset({SpecState.PARKED, SpecState.VERIFYING, SpecState.FAILED}),
    SpecState.PARKED: frozenset({SpecState.VERIFYING, SpecState.FAILED}),
    SpecState.VERIFYING: frozenset({SpecState.COMMITTED, SpecState.FAILED}),
    SpecState.COMMITTED: frozenset(),
    SpecState.FAILED: frozenset(),
}


class ParkReason(enum.Enum):
    CAP = "cap"  # its speculation window held (0: it waits for the Residual without drafting)
    FINISH = "finish"  # a held token would finish the request (EOS, stop, max_new_tokens)
    MEMORY = "memory"  # the decode batch ran out of KV space: parked instead of retracted
    DRAFT_MEMORY = "draft_memory"  # the draft distributions of sampled requests reached their budget
    UNVERIFIABLE = "unverifiable"  # sampling settings the verify pass cannot reproduce


@dataclass
class HeldTokens:
    """The tokens a request decoded on Anchor KV and has not released yet.

    ``draft_probs`` keeps, per held token, the distribution it was sampled from (sampled
    requests; None for greedy ones): the acceptance rule needs it.
    """

    cap: int
    state: SpecState = SpecState.SPECULATIVE
    tokens: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] | None = None
    park_reason: ParkReason | None = None
    late: bool = False  # the late token (see PARKED) was held

    def __post_init__(self) -> None:
        if self.cap < 0:
            raise ValueError(f"the speculative cap must be >= 0, got {self.cap}")

    def move(self, state: SpecState) -> None:
        if state not in SPEC_TRANSITIONS[self.state]:
            raise ValueError(f"speculative state {self.state.value} -> {state.value} is not allowed")
        self.state = state

    def hold(self, token: int, probs: torch.Tensor | None = None, *, finishes: bool = False) -> None:
        """Record one token decoded on Anchor KV; park if it would finish the request
        (``finishes``, which only counts once verified; also when it fills the cap: the
        reason that says more) or at the cap."""
        if self.state is not SpecState.SPECULATIVE:
            raise ValueError(f"cannot hold a token in state {self.state.value}")
        self._append(token, probs)
        if finishes:
            self.park(ParkReason.FINISH)
        elif len(self.tokens) >= self.cap:
            self.park(ParkReason.CAP)

    def hold_late(self, token: int, probs: torch.Tensor | None = None) -> None:
        """Record the token of the step the overlap scheduler launched before the park."""
        if self.state is not SpecState.PARKED or self.late:
            raise ValueError(
                f"a late token arrives once, after the park; state {self.state.value}, late {self.late}"
            )
        self._append(token, probs)
        self.late = True

    def _append(self, token: int, probs: torch.Tensor | None) -> None:
        if (probs is None) != (self.draft_probs is None):
            raise ValueError(
                "a sampled request holds each token with its draft distribution, a greedy one without"
            )
        self.tokens.append(token)
        if self.draft_probs is not None:
            assert probs is not None
            self.draft_probs.append(probs)

    def park(self, reason: ParkReason) -> None:
        self.move(SpecState.PARKED)
        self.park_reason = reason

    def verifying(self) -> None:
        self.move(SpecState.VERIFYING)

    def committed(self, accepted: int) -> list[int]:
        """Drop the held tokens after the first ``accepted``; returns the dropped ones."""
        if not 0 <= accepted <= len(self.tokens):
            raise ValueError(f"accepted {accepted} of {len(self.tokens)} held tokens")
        self.move(SpecState.COMMITTED)
        dropped = self.tokens[accepted:]
        del self.tokens[accepted:]
        if self.draft_probs is not None:
            del self.draft_probs[accepted:]
        return dropped
