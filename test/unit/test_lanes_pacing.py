import pytest

from lynx.lanes.pacing import DrainRate

MS = 1e-3


def chunk(rate: DrainRate) -> int:
    return rate.chunk_bytes(2 * MS, default=777, lo=100, hi=10**9)


def test_default_until_measured():
    rate = DrainRate()
    assert chunk(rate) == 777
    rate.landed(1000, 1.0, busy=False)  # nothing started: ignored
    assert rate.rate is None


def test_busy_window_gives_the_rate_and_chunk_is_link_time():
    rate = DrainRate(min_window_s=1 * MS)
    rate.started(0.0)
    rate.landed(400, 0.4 * MS, busy=True)  # window too short yet: accumulates
    assert rate.rate is None
    rate.landed(600, 1 * MS, busy=True)
    assert rate.rate == pytest.approx(1e6)  # 1000 B in 1 ms
    assert chunk(rate) == 2000


def test_idle_gaps_do_not_count_and_samples_are_smoothed():
    rate = DrainRate(alpha=0.5)
    rate.started(0.0)
    rate.landed(1000, 1 * MS, busy=False)
    assert rate.rate == pytest.approx(1e6)
    rate.started(5.0)  # after 5 s idle
    rate.landed(3000, 5.0 + 1 * MS, busy=False)  # 3e6 B/s in its own window
    assert rate.rate == pytest.approx(2e6)
    rate.started(6.0)
    rate.started(6.0 + 0.5 * MS)  # already busy: the window keeps its start
    rate.landed(2000, 6.0 + 1 * MS, busy=False)
    assert rate.rate == pytest.approx(2e6)


def test_chunk_is_clamped():
    rate = DrainRate()
    rate.started(0.0)
    rate.landed(10, 1.0, busy=False)  # 10 B/s
    assert rate.chunk_bytes(2 * MS, default=777, lo=100, hi=1000) == 100
    rate.started(2.0)
    rate.landed(10**12, 3.0, busy=False)
    assert rate.chunk_bytes(2 * MS, default=777, lo=100, hi=1000) == 1000
