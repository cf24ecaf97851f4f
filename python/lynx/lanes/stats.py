"""Per-lane counters and latency samples, exposed as immutable snapshots for metrics."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_SAMPLES_KEPT = 4096  # latency percentiles cover the most recent samples only


@dataclass(frozen=True)
class Percentiles:
    """Summary of the last `count` samples, in seconds (all 0.0 when there are none)."""

    count: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, samples: deque[float]) -> Percentiles:
        if not samples:
            return cls(0, 0.0, 0.0, 0.0)
        ordered = sorted(samples)
        last = len(ordered) - 1
        return cls(len(ordered), ordered[round(0.5 * last)], ordered[round(0.99 * last)], ordered[-1])


@dataclass(frozen=True)
class LaneStats:
    """One lane's totals since the scheduler started.

    `queue_delay`: per chunk, from the `submit()` call that queued its bytes to its
    submission to the engine. `completion_latency`: per completed stream, from its last
    `submit()` call (the one with `last=True`) to its last byte landing: the latency a
    receiver waiting for the stream sees once the sender has produced all of it.
    """

    bytes: int
    chunks: int
    chunks_failed: int
    streams_done: int
    streams_failed: int
    streams_aborted: int
    queue_delay: Percentiles
    completion_latency: Percentiles


@dataclass(frozen=True)
class SchedulerStats:
    high: LaneStats
    low: LaneStats
    driver_cpu_s: float  # CPU time of the driver thread (engine polling included)
    polls: int  # backend.poll calls
    driver_alive: bool  # False once the driver thread ended (closed, or died): nothing moves
    driver_errors: int  # driver passes that raised (each failed the open requests)


class LaneRecorder:
    """Mutable counters behind a `LaneStats`; the scheduler updates it under its lock."""

    def __init__(self) -> None:
        self.bytes = 0
        self.chunks = 0
        self.chunks_failed = 0
        self.streams_done = 0
        self.streams_failed = 0
        self.streams_aborted = 0
        self.queue_delays: deque[float] = deque(maxlen=_SAMPLES_KEPT)
        self.completion_latencies: deque[float] = deque(maxlen=_SAMPLES_KEPT)

    def snapshot(self) -> LaneStats:
        return LaneStats(
            bytes=self.bytes,
            chunks=self.chunks,
            chunks_failed=self.chunks_failed,
            streams_done=self.streams_done,
            streams_failed=self.streams_failed,
            streams_aborted=self.streams_aborted,
            queue_delay=Percentiles.of(self.queue_delays),
            completion_latency=Percentiles.of(self.completion_latencies),
        )
