"""What the tensor-parallel ranks of a decode server agree on before they act.

Every TP rank runs its own scheduler over the same requests and receives its own heads'
Anchor and Residual over its own lanes, so each rank sees a Residual land (or fail) in
its own iteration, and times its own transfers. The verify forward is a collective (its
all-reduces span the ranks), and parking or committing a request changes the batch every
rank must launch next, so the speculative decisions must be the same on every rank. Once
per scheduler iteration, before acting, the ranks reduce one small vector with MIN
(upstream's ``all_reduce_flags`` over the attention-TP gloo group, as upstream does for
its transfer polls):

per tracked request, in the order the ranks admitted them:

* its speculation window: the smallest any rank estimated (the estimates come from
  per-rank timings; only a request admitted since the last agreement can differ, and it
  holds no token yet);
* its Residual verdict, ``FAIL < WAIT < READY``: a request is verified only once every
  rank refined its KV, and fails if any rank's Residual failed;
* a key of its room, and the key's negation: MIN of both is the key itself only if every
  rank tracks the same requests in the same order; anything else is a bug that would
  desynchronise the ranks' batches, raised as :class:`RankDivergenceError`.

With a single rank the reduction is the identity and no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lynx.verdict import Verdict

ReduceMin = Callable[[list[int]], list[int]]
"""Elementwise MIN of an int32 vector over the ranks (every rank passes the same length)."""

VERDICT_ORDER: tuple[Verdict, ...] = (Verdict.FAIL, Verdict.WAIT, Verdict.READY)
_ROOM_KEY_MASK = (1 << 31) - 1


class RankDivergenceError(RuntimeError):
    """The TP ranks disagree on which requests speculate (a Lynx bug)."""


@dataclass(frozen=True)
class RankAgreement:
    """Per tracked request, what every rank acts on."""

    windows: list[int]
    verdicts: list[Verdict]
    others_failed: list[bool]  # FAIL agreed while this rank's own verdict was not FAIL


def agree(
    rooms: Sequence[int],
    windows: Sequence[int],
    verdicts: Sequence[Verdict],
    reduce_min: ReduceMin | None,
) -> RankAgreement:
    """Agree with the other ranks (``reduce_min``; None: this is the only rank) on the
    windows and Residual verdicts of the tracked requests of ``rooms``."""
    n = len(rooms)
    if len(windows) != n or len(verdicts) != n:
        raise ValueError(f"{len(windows)} windows and {len(verdicts)} verdicts for {n} rooms")
    if any(w < 0 for w in windows):
        raise ValueError(f"speculation windows must be >= 0, got {list(windows)}")
    keys = [room & _ROOM_KEY_MASK for room in rooms]
    local = [*windows, *(VERDICT_ORDER.index(v) for v in verdicts), *keys, *(-k for k in keys)]
    agreed = local if reduce_min is None or not local else reduce_min(local)
    if len(agreed) != len(local):
        raise RankDivergenceError(f"the rank reduction returned {len(agreed)} values for {len(local)}")
    low, high = agreed[2 * n : 3 * n], [-k for k in agreed[3 * n :]]
    if low != keys or high != keys:
        raise RankDivergenceError(
            "the TP ranks of this decode server track different speculative requests: "
            f"this rank's room keys {keys}, smallest {low}, largest {high}"
        )
    agreed_verdicts = [VERDICT_ORDER[c] for c in agreed[n : 2 * n]]
    return RankAgreement(
        windows=list(agreed[:n]),
        verdicts=agreed_verdicts,
        others_failed=[
            theirs is Verdict.FAIL and mine is not Verdict.FAIL
            for mine, theirs in zip(verdicts, agreed_verdicts, strict=True)
        ],
    )
