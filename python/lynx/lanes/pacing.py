"""How fast a peer drains, to size LOW chunks in link time rather than in bytes.

A HIGH write waits behind the LOW bytes already in the engine, and LOW throughput needs
enough of them in flight to hide the per-chunk round trip through the driver. Both are
matters of *time*: measured here, ~2 ms of link time per chunk kept LOW throughput at
FIFO's level on loopback (~1.9 GB/s: 4 MiB chunks) and on a 1 Gbit/s link (256 KiB),
where any fixed byte size was too small for one or too large for the other.
"""

from __future__ import annotations


class DrainRate:
    """Bytes per second a peer drains while it has writes in the engine (both lanes).

    Measured over busy windows: from the moment the peer's first write enters an idle
    engine, bytes landed over elapsed time, sampled once a window spans `min_window_s`
    (writes to one peer run in parallel on several connections, so per-write durations
    say little) and smoothed with an exponential moving average. A write is credited to
    the window it lands in although it started in the previous one: windows several chunk
    times long (10 ms vs 2 ms chunks) keep that over-count small (it was visible with 1 ms).
    """

    def __init__(self, min_window_s: float = 10e-3, alpha: float = 0.3) -> None:
        self.rate: float | None = None
        self._min_window_s = min_window_s
        self._alpha = alpha
        self._window_start: float | None = None
        self._window_bytes = 0

    def started(self, now: float) -> None:
        """A write entered the engine; opens a window if the peer was idle."""
        if self._window_start is None:
            self._window_start = now
            self._window_bytes = 0

    def landed(self, nbytes: int, now: float, busy: bool) -> None:
        """A write resolved (`nbytes` 0 if it failed); `busy`: others are still in flight."""
        if self._window_start is None:
            return
        self._window_bytes += nbytes
        span = now - self._window_start
        if span >= self._min_window_s or (not busy and span > 0):
            sample = self._window_bytes / span
            old = self.rate
            self.rate = sample if old is None else old + self._alpha * (sample - old)
            self._window_start = now if busy else None
            self._window_bytes = 0
        elif not busy:
            self._window_start = None

    def chunk_bytes(self, seconds: float, default: int, lo: int, hi: int) -> int:
        """`seconds` of link time at the measured rate, within [lo, hi]; `default` until
        there is a measurement."""
        if self.rate is None:
            return default
        return max(lo, min(hi, int(self.rate * seconds)))
