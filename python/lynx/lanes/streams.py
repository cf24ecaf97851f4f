"""The lanes' vocabulary: the two lanes, a stream's states and status, the errors, and
the scheduling knobs (:class:`LaneConfig`). See :mod:`lynx.lanes.scheduler`."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

MAX_DEADLINE_S = 3600.0
"""Longest per-request deadline: a transfer still open after an hour has a dead peer, and
a finite bound keeps every wait the driver computes representable."""


def check_deadline(seconds: float, what: str = "deadline_s") -> None:
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_DEADLINE_S):
        raise ValueError(f"{what} must be in (0, {MAX_DEADLINE_S:g}] seconds, got {seconds}")


class Lane(enum.IntEnum):
    """HIGH carries the Anchor (and small auxiliary data); LOW carries the Residual."""

    HIGH = 0
    LOW = 1


class StreamState(enum.Enum):
    IDLE = "idle"  # registered, nothing submitted yet
    OPEN = "open"  # bytes submitted, not all landed or `last` not yet seen
    DONE = "done"  # every byte landed after the last submit
    FAILED = "failed"  # the engine failed a write of this request, or its deadline passed
    ABORTED = "aborted"  # abort() was called before the stream finished


STREAM_TRANSITIONS: dict[StreamState, frozenset[StreamState]] = {
    StreamState.IDLE: frozenset({StreamState.OPEN, StreamState.FAILED, StreamState.ABORTED}),
    StreamState.OPEN: frozenset({StreamState.DONE, StreamState.FAILED, StreamState.ABORTED}),
    StreamState.DONE: frozenset(),
    StreamState.FAILED: frozenset(),
    StreamState.ABORTED: frozenset(),
}
TERMINAL_STATES = frozenset(s for s, nxt in STREAM_TRANSITIONS.items() if not nxt)


class LaneError(RuntimeError):
    """A lanes operation that the current state of a request does not allow."""


class StreamClosedError(LaneError):
    """`submit` on a stream that already got `last=True` or has settled."""


@dataclass(frozen=True)
class StreamStatus:
    request_id: str
    lane: Lane
    state: StreamState
    bytes_submitted: int
    bytes_done: int
    error: str | None
    parts_landed: int = 0  # submit calls with bytes, all landed with every earlier one


@dataclass(frozen=True)
class LaneConfig:
    """Scheduling knobs; defaults from benchmark/lanes.py (loopback and a 1 Gbit/s link)."""

    # LOW chunk size: `low_chunk_s` of link time at the peer's measured drain rate, within
    # [low_chunk_min_bytes, low_chunk_max_bytes]; `low_chunk_bytes` until it is measured,
    # and always if `low_chunk_s` is None.
    low_chunk_s: float | None = 2e-3
    low_chunk_bytes: int = 1 << 20
    low_chunk_min_bytes: int = 64 << 10
    low_chunk_max_bytes: int = 16 << 20
    low_inflight: int = 2  # LOW chunks in the engine per peer: what a HIGH write competes with
    deadline_s: float = 30.0  # default per-request deadline, from register_destination
    poll_min_s: float = 50e-6
    poll_max_s: float = 1e-3
    # While HIGH writes are in the engine: their landing is what receivers wait for, and
    # what LOW waits for to resume, so it is noticed within this, not within poll_max_s.
    # (Mooncake runs a peer's first 4 transfers in parallel, one per TCP connection, so a
    # HIGH write may land before LOW chunks submitted ahead of it.)
    poll_high_s: float = 100e-6
    # ... unless every peer with HIGH writes in the engine has a measured drain rate: then
    # the driver sleeps an eighth of the soonest time one of them can drain its bytes in
    # the engine, within [poll_high_s, poll_high_max_s]. On a slow link HIGH writes are in
    # the engine for seconds (an Anchor sent layer by layer during prefill's forward), and
    # polling each 100 us took 14% of a core and the GIL from that forward (SmolLM2 2k at
    # 20 Mbit/s); a landing is still noticed within an eighth of its write's link time.
    poll_high_max_s: float = 5e-3

    def __post_init__(self) -> None:
        if self.low_chunk_bytes <= 0 or self.low_inflight <= 0:
            raise ValueError("low_chunk_bytes and low_inflight must be positive")
        if self.low_chunk_s is not None and self.low_chunk_s <= 0:
            raise ValueError("low_chunk_s must be positive (or None for fixed chunks)")
        if not 0 < self.low_chunk_min_bytes <= self.low_chunk_max_bytes:
            raise ValueError("need 0 < low_chunk_min_bytes <= low_chunk_max_bytes")
        check_deadline(self.deadline_s)
        if not 0 < self.poll_min_s <= self.poll_max_s:
            raise ValueError("need 0 < poll_min_s <= poll_max_s")
        if not 0 < self.poll_high_s <= self.poll_max_s:
            raise ValueError("need 0 < poll_high_s <= poll_max_s")
        if self.poll_high_max_s < self.poll_high_s:
            raise ValueError("need poll_high_s <= poll_high_max_s")
