"""Scheduling logic of the lanes, against a fake engine the test completes by hand."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx.lanes import (
    STREAM_TRANSITIONS,
    AddressError,
    BatchState,
    Lane,
    LaneConfig,
    LaneError,
    LaneScheduler,
    StreamClosedError,
    StreamState,
    StreamStatus,
    Transfer,
)

KIB = 1024
SRC = 0x10_0000
SRC_LEN = 64 * KIB * KIB
DST = 0x9000_0000
PEER = "peer-a:1"


@dataclass
class FakeBatch:
    peer: str
    transfers: list[Transfer]
    state: BatchState
    polls: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.length for t in self.transfers)


class FakeBackend:
    """Records batches; they stay PENDING until the test resolves them (or `auto`)."""

    session_id = "fake:0"

    def __init__(self, auto: bool = False) -> None:
        self.auto = auto
        self.cond = threading.Condition()
        self.batches: list[FakeBatch] = []
        self.registered: dict[int, int] = {}
        self.unreachable: set[str] = set()
        self.probes: list[str] = []

    def probe(self, peer: str) -> bool:
        self.probes.append(peer)
        return peer not in self.unreachable

    def register_memory(self, addr: int, length: int) -> None:
        self.registered[addr] = length

    def unregister_memory(self, addr: int) -> None:
        del self.registered[addr]

    def submit_write(self, peer: str, transfers: Sequence[Transfer]) -> FakeBatch:
        state = BatchState.DONE if self.auto else BatchState.PENDING
        batch = FakeBatch(peer, list(transfers), state)
        with self.cond:
            self.batches.append(batch)
            self.cond.notify_all()
        return batch

    def poll(self, handle: object) -> BatchState:
        assert isinstance(handle, FakeBatch)
        with self.cond:
            handle.polls += 1
            self.cond.notify_all()
            return handle.state

    def resolve(self, batch: FakeBatch, state: BatchState = BatchState.DONE) -> None:
        with self.cond:
            batch.state = state

    def drain(self) -> None:
        """Complete everything in flight now and from now on."""
        with self.cond:
            self.auto = True
            for batch in self.batches:
                if batch.state is BatchState.PENDING:
                    batch.state = BatchState.DONE

    def wait_batches(self, n: int) -> list[FakeBatch]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.batches) >= n, 5), self.batches
            return list(self.batches)

    def let_driver_cycle(self, batch: FakeBatch, cycles: int = 3) -> None:
        """Wait until the driver has polled `batch` `cycles` more times: each poll comes
        after a planning pass, so whatever the driver would submit now has been."""
        with self.cond:
            target = batch.polls + cycles
            assert self.cond.wait_for(lambda: batch.polls >= target, 5)


@pytest.fixture
def fake():
    return FakeBackend()


def make(backend, **config) -> tuple[LaneScheduler, list[StreamStatus]]:
    settled: list[StreamStatus] = []
    config.setdefault("low_chunk_s", None)  # fixed chunk sizes, unless a test paces them
    config.setdefault("low_chunk_bytes", 64 * KIB)
    config.setdefault("low_inflight", 2)
    config.setdefault("poll_max_s", 1e-3)
    lanes = LaneScheduler(backend, LaneConfig(**config), on_settled=settled.append)
    lanes.register_source(SRC, SRC_LEN)
    return lanes, settled


def grant(scheduler, rid, offset, length, peer=PEER, **kw):
    scheduler.register_destination(rid, peer, [(DST + offset, length)], **kw)


def test_stream_state_machine_is_pinned():
    s = StreamState
    assert {k: set(v) for k, v in STREAM_TRANSITIONS.items()} == {
        s.IDLE: {s.OPEN, s.FAILED, s.ABORTED},
        s.OPEN: {s.DONE, s.FAILED, s.ABORTED},
        s.DONE: set(),
        s.FAILED: set(),
        s.ABORTED: set(),
    }


def test_single_stream_completes_after_last_submit_and_all_bytes(fake):
    lanes, settled = make(fake)
    grant(lanes, "r", 0, 1024 * KIB, lanes=[Lane.HIGH])
    assert lanes.status("r", Lane.HIGH).state is StreamState.IDLE
    lanes.submit("r", Lane.HIGH, [(SRC, DST, 100 * KIB)], last=False)
    (b1,) = fake.wait_batches(1)
    fake.resolve(b1)
    lanes.submit("r", Lane.HIGH, [(SRC + 100 * KIB, DST + 100 * KIB, 28 * KIB)], last=True)
    b2 = fake.wait_batches(2)[1]
    fake.let_driver_cycle(b2)
    assert lanes.status("r", Lane.HIGH).state is StreamState.OPEN
    fake.resolve(b2)
    status = lanes.wait("r", Lane.HIGH, timeout=5)
    assert status == StreamStatus("r", Lane.HIGH, StreamState.DONE, 128 * KIB, 128 * KIB, None, 2)
    lanes.close()
    assert settled == [status]
    stats = lanes.stats()
    assert (stats.high.bytes, stats.high.chunks, stats.high.streams_done) == (128 * KIB, 2, 1)
    assert stats.high.completion_latency.count == 1
    assert stats.high.queue_delay.count == 2


def test_low_is_chunked_and_bounded_in_flight(fake):
    lanes, _ = make(fake, low_chunk_bytes=64 * KIB, low_inflight=2)
    grant(lanes, "r", 0, 1024 * KIB)
    lanes.submit("r", Lane.LOW, [(SRC, DST, 300 * KIB)], last=True)
    first = fake.wait_batches(2)
    fake.let_driver_cycle(first[0])
    assert len(fake.batches) == 2
    sizes = []
    while len(sizes) < 5:
        batch = fake.batches[len(sizes)]
        sizes.append(batch.nbytes)
        fake.resolve(batch)
        if len(sizes) < 5:
            fake.wait_batches(min(len(sizes) + 2, 5))
    assert sizes == [64 * KIB] * 4 + [44 * KIB]
    assert lanes.wait("r", Lane.LOW, 5).state is StreamState.DONE
    offsets = [(b.transfers[0].src - SRC, b.transfers[0].dst - DST) for b in fake.batches]
    assert offsets == [(i * 64 * KIB, i * 64 * KIB) for i in range(5)]
    lanes.close()


def test_parts_land_in_submit_order_whatever_order_the_engine_lands_their_chunks(fake):
    """A stream's parts (its submit calls with bytes) count as landed only with every
    earlier one; on_progress reports each advance of an open stream, in order, and the
    advance that settles it is the settle's alone (its last part needs no notice)."""
    progress: list[StreamStatus] = []
    lanes = LaneScheduler(
        fake,
        LaneConfig(low_chunk_s=None, low_chunk_bytes=64 * KIB, low_inflight=2, poll_max_s=1e-3),
        on_progress=progress.append,
    )
    lanes.register_source(SRC, SRC_LEN)
    grant(lanes, "r", 0, 1024 * KIB, lanes=[Lane.LOW])
    lanes.submit("r", Lane.LOW, [(SRC, DST, 64 * KIB)], last=False)  # part 1: one chunk
    lanes.submit("r", Lane.LOW, [(SRC + 64 * KIB, DST + 64 * KIB, 128 * KIB)], last=False)  # part 2: two
    lanes.submit("r", Lane.LOW, [], last=False)  # no bytes: no part
    lanes.submit("r", Lane.LOW, [(SRC + 192 * KIB, DST + 192 * KIB, 64 * KIB)], last=True)  # part 3
    first, second = fake.wait_batches(2)
    fake.resolve(second)  # part 2's first chunk lands before part 1's
    third = fake.wait_batches(3)[2]  # part 2's second chunk takes the free slot
    fake.let_driver_cycle(first)
    assert lanes.status("r", Lane.LOW).parts_landed == 0 and not progress
    fake.resolve(first)
    fourth = fake.wait_batches(4)[3]
    fake.let_driver_cycle(third)
    assert [p.parts_landed for p in progress] == [1]
    fake.resolve(third)
    fake.let_driver_cycle(fourth)
    assert [p.parts_landed for p in progress] == [1, 2]
    assert all(p.state is StreamState.OPEN for p in progress)
    fake.resolve(fourth)
    status = lanes.wait("r", Lane.LOW, 5)
    assert (status.state, status.parts_landed) == (StreamState.DONE, 3)
    lanes.close()
    assert [p.parts_landed for p in progress] == [1, 2]


def test_high_goes_at_once_and_pauses_low_until_landed(fake):
    lanes, _ = make(fake, low_inflight=2)
    grant(lanes, "bulk", 0, 4096 * KIB)
    grant(lanes, "anchor", 4096 * KIB, 64 * KIB)
    lanes.submit("bulk", Lane.LOW, [(SRC, DST, 4096 * KIB)], last=True)
    low1, low2 = fake.wait_batches(2)
    lanes.submit("anchor", Lane.HIGH, [(SRC, DST + 4096 * KIB, 64 * KIB)], last=True)
    high = fake.wait_batches(3)[2]
    assert high.transfers == [Transfer(SRC, DST + 4096 * KIB, 64 * KIB)]
    # LOW slots free up, but no LOW chunk may follow while the HIGH write is in the engine.
    fake.resolve(low1)
    fake.resolve(low2)
    fake.let_driver_cycle(high)
    assert len(fake.batches) == 3
    fake.resolve(high)
    assert lanes.wait("anchor", Lane.HIGH, 5).state is StreamState.DONE
    assert [b.nbytes for b in fake.wait_batches(5)[3:5]] == [64 * KIB, 64 * KIB]
    fake.drain()
    assert lanes.close()


def test_high_queued_behind_nothing_even_with_low_slots_full(fake):
    lanes, _ = make(fake, low_inflight=1)
    grant(lanes, "bulk", 0, 1024 * KIB)
    grant(lanes, "a1", 2048 * KIB, 64 * KIB, lanes=[Lane.HIGH])
    grant(lanes, "a2", 3072 * KIB, 64 * KIB, lanes=[Lane.HIGH])
    lanes.submit("bulk", Lane.LOW, [(SRC, DST, 1024 * KIB)], last=True)
    fake.wait_batches(1)
    lanes.submit("a1", Lane.HIGH, [(SRC, DST + 2048 * KIB, 4 * KIB)], last=True)
    lanes.submit("a2", Lane.HIGH, [(SRC, DST + 3072 * KIB, 4 * KIB)], last=True)
    batches = fake.wait_batches(3)
    assert [b.transfers[0].dst for b in batches[1:]] == [DST + 2048 * KIB, DST + 3072 * KIB]
    fake.drain()
    assert lanes.close()


def test_low_is_fifo_by_arrival_across_requests(fake):
    lanes, _ = make(fake, low_inflight=1, low_chunk_bytes=64 * KIB)
    for i, rid in enumerate("abc"):
        grant(lanes, rid, i * 1024 * KIB, 1024 * KIB, lanes=[Lane.LOW])
    lanes.submit("a", Lane.LOW, [(SRC, DST, 100 * KIB)], last=False)
    lanes.submit("b", Lane.LOW, [(SRC, DST + 1024 * KIB, 64 * KIB)], last=True)
    lanes.submit("a", Lane.LOW, [(SRC, DST + 100 * KIB, 10 * KIB)], last=True)
    lanes.submit("c", Lane.LOW, [(SRC, DST + 2048 * KIB, 64 * KIB)], last=True)
    order = []
    for n in range(1, 6):
        batch = fake.wait_batches(n)[-1]
        order.append(((batch.transfers[0].dst - DST) // (1024 * KIB), batch.nbytes // KIB))
        fake.resolve(batch)
    # A chunk never spans two submit calls: "a" is cut 64+36, its second call comes later.
    assert order == [(0, 64), (0, 36), (1, 64), (0, 10), (2, 64)]
    for rid in "abc":
        assert lanes.wait(rid, Lane.LOW, 5).state is StreamState.DONE
    lanes.close()


def test_contiguous_transfers_coalesce_but_not_across_source_buffers(fake):
    lanes, _ = make(fake)
    lanes.register_source(SRC + SRC_LEN, 1024 * KIB)  # adjacent, separately registered
    grant(lanes, "r", 0, 4096 * KIB, lanes=[Lane.HIGH])
    end = SRC + SRC_LEN
    lanes.submit(
        "r",
        Lane.HIGH,
        [
            (SRC, DST, 4 * KIB),
            (SRC + 4 * KIB, DST + 4 * KIB, 4 * KIB),  # contiguous both sides: merged
            (SRC + 16 * KIB, DST + 8 * KIB, 4 * KIB),  # source gap: separate
            (end - 4 * KIB, DST + 100 * KIB, 4 * KIB),
            (end, DST + 104 * KIB, 4 * KIB),  # next source buffer: separate
        ],
        last=True,
    )
    (batch,) = fake.wait_batches(1)
    assert batch.transfers == [
        Transfer(SRC, DST, 8 * KIB),
        Transfer(SRC + 16 * KIB, DST + 8 * KIB, 4 * KIB),
        Transfer(end - 4 * KIB, DST + 100 * KIB, 4 * KIB),
        Transfer(end, DST + 104 * KIB, 4 * KIB),
    ]
    fake.drain()
    assert lanes.close()


@pytest.mark.parametrize(
    ("transfer", "match"),
    [
        ((SRC - 1, DST, 16), "outside every registered source"),
        ((SRC + SRC_LEN - 8, DST, 16), "outside every registered source"),
        ((SRC, DST + 64 * KIB - 8, 16), "outside the ranges granted"),
        ((SRC, DST + 64 * KIB, 16), "outside the ranges granted"),  # the other request's page
        ((SRC, DST - 16, 16), "outside the ranges granted"),
        ((SRC, DST, 0), "invalid span"),
        ((SRC, -DST, 16), "invalid span"),
        ((SRC, DST, True), "must be an int"),
        ((SRC, float(DST), 16), "must be an int"),
        ((SRC, DST), "triples"),
    ],
)
def test_bad_transfers_are_refused_before_the_engine(fake, transfer, match):
    lanes, _ = make(fake)
    grant(lanes, "r", 0, 64 * KIB)
    grant(lanes, "other", 64 * KIB, 64 * KIB)
    good = (SRC, DST, 16)
    with pytest.raises(AddressError, match=match):
        lanes.submit("r", Lane.HIGH, [good, transfer], last=True)
    assert lanes.status("r", Lane.HIGH) == StreamStatus("r", Lane.HIGH, StreamState.IDLE, 0, 0, None)
    lanes.close()
    assert fake.batches == []


def test_closed_and_unknown_streams_raise(fake):
    lanes, _ = make(fake)
    grant(lanes, "r", 0, 64 * KIB, lanes=[Lane.HIGH])
    with pytest.raises(LaneError, match="has no LOW lane"):
        lanes.submit("r", Lane.LOW, [(SRC, DST, 16)], last=True)
    with pytest.raises(KeyError, match="unknown request 'nope'"):
        lanes.submit("nope", Lane.HIGH, [], last=True)
    with pytest.raises(LaneError, match="already registered"):
        grant(lanes, "r", 0, 64 * KIB)
    lanes.submit("r", Lane.HIGH, [], last=True)  # an empty stream completes at once
    assert lanes.wait("r", Lane.HIGH, 5).state is StreamState.DONE
    with pytest.raises(StreamClosedError, match="done and got last=True"):
        lanes.submit("r", Lane.HIGH, [(SRC, DST, 16)], last=True)
    lanes.close()
    assert fake.batches == []


def test_engine_failure_fails_exactly_that_request(fake):
    lanes, settled = make(fake, low_inflight=1)
    grant(lanes, "bad", 0, 1024 * KIB)
    grant(lanes, "good", 1024 * KIB, 1024 * KIB)
    lanes.submit("bad", Lane.LOW, [(SRC, DST, 256 * KIB)], last=True)
    lanes.submit("good", Lane.LOW, [(SRC, DST + 1024 * KIB, 64 * KIB)], last=True)
    (first,) = fake.wait_batches(1)
    fake.resolve(first, BatchState.FAILED)
    status = lanes.wait("bad", Lane.LOW, 5)
    assert status.state is StreamState.FAILED
    assert "LOW write to peer-a:1 failed" in (status.error or "")
    # The request's other lane fails with it, although nothing was ever submitted on it.
    assert lanes.status("bad", Lane.HIGH).state is StreamState.FAILED
    good = fake.wait_batches(2)[1]
    assert good.transfers[0].dst == DST + 1024 * KIB  # bad's queued chunks were dropped
    fake.resolve(good)
    assert lanes.wait("good", Lane.LOW, 5).state is StreamState.DONE
    with pytest.raises(StreamClosedError, match="failed"):
        lanes.submit("bad", Lane.HIGH, [(SRC, DST, 16)], last=True)
    lanes.close()
    assert len(fake.batches) == 2
    assert {(s.request_id, s.lane, s.state) for s in settled} == {
        ("bad", Lane.HIGH, StreamState.FAILED),
        ("bad", Lane.LOW, StreamState.FAILED),
        ("good", Lane.LOW, StreamState.DONE),
        ("good", Lane.HIGH, StreamState.ABORTED),  # closed with an unused lane
    }
    assert len(settled) == 4
    assert lanes.stats().low.chunks_failed == 1


def test_abort_drops_queued_work_and_release_waits_for_the_engine(fake):
    lanes, _ = make(fake, low_inflight=1)
    grant(lanes, "r", 0, 1024 * KIB)
    grant(lanes, "next", 1024 * KIB, 64 * KIB, lanes=[Lane.LOW])
    lanes.submit("r", Lane.LOW, [(SRC, DST, 512 * KIB)], last=True)
    lanes.submit("next", Lane.LOW, [(SRC, DST + 1024 * KIB, 64 * KIB)], last=True)
    (in_flight,) = fake.wait_batches(1)
    assert lanes.abort("r")
    assert not lanes.abort("r")
    assert lanes.status("r", Lane.LOW).state is StreamState.ABORTED
    with pytest.raises(LaneError, match="1 writes still in the engine"):
        lanes.release("r")
    fake.resolve(in_flight)
    nxt = fake.wait_batches(2)[1]
    assert nxt.transfers[0].dst == DST + 1024 * KIB
    assert lanes.status("r", Lane.LOW).bytes_done == 0  # landed after the abort: not counted
    lanes.release("r")
    with pytest.raises(KeyError):
        lanes.status("r", Lane.LOW)
    fake.resolve(nxt)
    assert lanes.wait("next", Lane.LOW, 5).state is StreamState.DONE
    with pytest.raises(LaneError, match="open streams"):
        grant(lanes, "open", 0, 16)
        lanes.release("open")
    lanes.close()
    assert lanes.stats().low.streams_aborted == 2  # "r", then "open" on close


def test_deadline_fails_a_stuck_request_and_not_the_others(fake):
    lanes, _ = make(fake)
    grant(lanes, "frozen", 0, 64 * KIB, deadline_s=0.2)
    grant(lanes, "fine", 64 * KIB, 64 * KIB, lanes=[Lane.HIGH], deadline_s=60)
    lanes.submit("frozen", Lane.HIGH, [(SRC, DST, 16)], last=True)
    stuck = fake.wait_batches(1)[0]
    status = lanes.wait("frozen", Lane.HIGH, 5)
    assert status.state is StreamState.FAILED
    assert status.error == (
        "deadline of 0.2 s passed (HIGH: 0 of 16 bytes landed, 0 queued, last part submitted; "
        "LOW: 0 of 0 bytes landed, 0 queued, last part not submitted yet; 1 write(s) in the engine)"
    )
    assert lanes.status("frozen", Lane.LOW).state is StreamState.FAILED
    lanes.submit("fine", Lane.HIGH, [(SRC, DST + 64 * KIB, 16)], last=True)
    fine = fake.wait_batches(2)[1]
    fake.resolve(fine)
    assert lanes.wait("fine", Lane.HIGH, 5).state is StreamState.DONE
    assert stuck.state is BatchState.PENDING
    assert not lanes.close(timeout=0.2)  # the frozen write never leaves the engine


class BlockingBackend(FakeBackend):
    """`submit_write` to the peers in `blocked` does not return until `unblock`: what
    Mooncake's TCP transport does when a frozen peer's listen backlog is full (it connects
    on the submitting thread)."""

    def __init__(self, blocked: set[str]) -> None:
        super().__init__()
        self.blocked = blocked
        self.released = threading.Event()
        self.entered: list[str] = []

    def submit_write(self, peer: str, transfers: Sequence[Transfer]) -> FakeBatch:
        if peer in self.blocked:
            with self.cond:
                self.entered.append(peer)
                self.cond.notify_all()
            self.released.wait()
            return FakeBatch(peer, list(transfers), BatchState.FAILED)
        return super().submit_write(peer, transfers)

    def wait_entered(self) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.entered, 5)

    def unblock(self) -> None:
        self.released.set()


def test_a_submit_that_blocks_stalls_neither_other_peers_nor_deadlines():
    backend = BlockingBackend({"frozen:1"})
    lanes, _ = make(backend, low_inflight=1)
    grant(lanes, "stuck", 0, 1024 * KIB, peer="frozen:1", deadline_s=0.2)
    grant(lanes, "fine", 0, 1024 * KIB, deadline_s=60)
    lanes.submit("stuck", Lane.LOW, [(SRC, DST, 256 * KIB)], last=True)
    backend.wait_entered()
    backend.drain()
    lanes.submit("fine", Lane.LOW, [(SRC, DST, 256 * KIB)], last=True)
    assert lanes.wait("fine", Lane.LOW, 5).state is StreamState.DONE
    status = lanes.wait("stuck", Lane.LOW, 5)
    assert status.state is StreamState.FAILED
    assert status.error is not None and status.error.endswith("1 write(s) in the engine)")
    with pytest.raises(LaneError, match="1 writes still in the engine"):
        lanes.release("stuck")  # the engine may yet read its source bytes
    backend.unblock()
    deadline = time.monotonic() + 5
    while True:
        try:
            lanes.release("stuck")
            break
        except LaneError:
            assert time.monotonic() < deadline, "the blocked write never resolved"
            time.sleep(0.01)
    # Only the chunk that was inside the blocked call reached the engine: the rest of the
    # failed request's bytes stayed in its queue and were dropped with it.
    assert backend.entered == ["frozen:1"]
    assert all(batch.peer == PEER for batch in backend.batches)
    assert lanes.close()


def test_chunks_of_a_request_that_failed_behind_a_blocked_submit_are_never_sent():
    backend = BlockingBackend({"frozen:1"})
    lanes, _ = make(backend, low_inflight=2)
    grant(lanes, "stuck", 0, 1024 * KIB, peer="frozen:1", deadline_s=0.2)
    lanes.submit("stuck", Lane.LOW, [(SRC, DST, 256 * KIB)], last=True)
    backend.wait_entered()  # the first chunk blocks; the second waits behind it
    assert lanes.wait("stuck", Lane.LOW, 5).state is StreamState.FAILED
    backend.unblock()
    deadline = time.monotonic() + 5
    while lanes.stats().low.chunks_failed == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lanes.release("stuck")
    assert backend.entered == ["frozen:1"]  # the second chunk never went to the engine
    assert lanes.close()


def test_deadline_also_covers_streams_never_started(fake):
    lanes, _ = make(fake)
    grant(lanes, "idle", 0, 64 * KIB, deadline_s=0.05)
    assert lanes.wait("idle", Lane.LOW, 5).state is StreamState.FAILED
    lanes.close()


def test_a_raising_callback_does_not_stop_the_driver(fake):
    calls = []

    def boom(status):
        calls.append(status.request_id)
        raise RuntimeError("callback bug")

    fake.auto = True
    lanes = LaneScheduler(fake, LaneConfig(), on_settled=boom)
    lanes.register_source(SRC, SRC_LEN)
    for rid in ("x", "y"):
        grant(lanes, rid, 0, 64 * KIB, lanes=[Lane.HIGH])
        lanes.submit(rid, Lane.HIGH, [(SRC, DST, 16)], last=True)
        assert lanes.wait(rid, Lane.HIGH, 5).state is StreamState.DONE
    assert lanes.close()
    assert calls == ["x", "y"]


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 0, -1, 3601])
def test_deadlines_are_finite_and_bounded(fake, seconds):
    # An infinite deadline once overflowed the driver's wait and killed it silently.
    with pytest.raises(ValueError, match="deadline_s"):
        LaneConfig(deadline_s=seconds)
    lanes, _ = make(fake)
    with pytest.raises(ValueError, match="deadline_s"):
        grant(lanes, "r", 0, 16, deadline_s=seconds)
    grant(lanes, "ok", 0, 16, lanes=[Lane.HIGH], deadline_s=3600)
    lanes.close()


class PollRaises(FakeBackend):
    """The engine's poll raises once, for the first batch it is asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = False

    def poll(self, handle: object) -> BatchState:
        if not self.raised:
            self.raised = True
            raise RuntimeError("engine poll broke")
        return super().poll(handle)


def test_a_raising_poll_fails_that_write_and_the_driver_goes_on():
    fake = PollRaises()
    lanes, _ = make(fake)
    grant(lanes, "a", 0, 64 * KIB, lanes=[Lane.HIGH])
    lanes.submit("a", Lane.HIGH, [(SRC, DST, 16)], last=True)
    status = lanes.wait("a", Lane.HIGH, 5)
    assert status.state is StreamState.FAILED and "failed in the engine" in status.error
    fake.drain()
    grant(lanes, "b", 64 * KIB, 64 * KIB, lanes=[Lane.HIGH])
    lanes.submit("b", Lane.HIGH, [(SRC, DST + 64 * KIB, 16)], last=True)
    assert lanes.wait("b", Lane.HIGH, 5).state is StreamState.DONE
    assert lanes.stats().driver_alive
    assert lanes.close()


def test_a_failed_driver_pass_fails_open_requests_and_the_driver_goes_on(fake, monkeypatch):
    lanes, _ = make(fake)
    grant(lanes, "a", 0, 64 * KIB)
    lanes.submit("a", Lane.HIGH, [(SRC, DST, 16)], last=True)
    (held,) = fake.wait_batches(1)  # in the engine when the pass breaks
    real_plan = lanes._planner.plan
    broken = threading.Event()

    def plan_once_broken(peers, now):
        if not broken.is_set():
            broken.set()
            raise RuntimeError("planning bug")
        return real_plan(peers, now)

    monkeypatch.setattr(lanes._planner, "plan", plan_once_broken)
    # on a busy host the broken pass may run first: it fails the open request then already
    with contextlib.suppress(StreamClosedError):
        lanes.submit("a", Lane.LOW, [(SRC, DST + 32, 16)], last=True)
    status = lanes.wait("a", Lane.LOW, 5)
    assert status.state is StreamState.FAILED
    assert status.error == "lanes driver error: RuntimeError: planning bug"
    with pytest.raises(LaneError, match="writes still in the engine"):
        lanes.release("a")  # the write in the engine is still tracked
    fake.resolve(held)
    deadline = time.monotonic() + 5
    while True:  # the driver polls the resolved write on its next pass
        try:
            lanes.release("a")
            break
        except LaneError:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert lanes.stats().driver_errors == 1 and lanes.stats().driver_alive
    fake.drain()
    grant(lanes, "b", 0, 64 * KIB)
    lanes.submit("b", Lane.HIGH, [(SRC, DST, 16)], last=True)
    lanes.submit("b", Lane.LOW, [(SRC, DST + 32, 32 * KIB)], last=True)
    assert lanes.wait("b", Lane.LOW, 5).state is StreamState.DONE  # LOW is not blocked
    assert lanes.close()


class DriverKilled(BaseException):
    """Something no driver pass can survive."""


def test_a_dead_driver_fails_open_requests_and_refuses_new_work(fake, monkeypatch):
    lanes, settled = make(fake)
    grant(lanes, "open", 0, 64 * KIB, lanes=[Lane.HIGH])

    def die(peers, now):
        raise DriverKilled("gone")

    monkeypatch.setattr(lanes._planner, "plan", die)
    lanes.submit("open", Lane.HIGH, [(SRC, DST, 16)], last=True)
    status = lanes.wait("open", Lane.HIGH, 5)
    assert status.state is StreamState.FAILED
    assert status.error == "lanes driver stopped (DriverKilled: gone)"
    assert [s.request_id for s in settled] == ["open"]  # the callback still heard it
    assert not lanes.stats().driver_alive
    with pytest.raises(LaneError, match="driver stopped"):
        grant(lanes, "new", 0, 16)
    with pytest.raises(LaneError, match="driver stopped"):
        lanes.submit("open", Lane.HIGH, [(SRC, DST, 16)], last=True)


def test_unregister_source_refused_while_writes_pending(fake):
    lanes, _ = make(fake)
    grant(lanes, "r", 0, 64 * KIB, lanes=[Lane.HIGH])
    lanes.submit("r", Lane.HIGH, [(SRC, DST, 16)], last=True)
    (batch,) = fake.wait_batches(1)
    with pytest.raises(LaneError, match="writes pending"):
        lanes.unregister_source(SRC)
    fake.resolve(batch)
    lanes.wait("r", Lane.HIGH, 5)
    lanes.unregister_source(SRC)
    assert fake.registered == {}
    lanes.close()


def test_config_is_validated():
    with pytest.raises(ValueError, match="positive"):
        LaneConfig(low_inflight=0)
    with pytest.raises(ValueError, match="poll_min_s"):
        LaneConfig(poll_min_s=1e-2, poll_max_s=1e-3)
    with pytest.raises(ValueError, match="poll_high_s"):
        LaneConfig(poll_high_s=2e-3, poll_max_s=1e-3)
    with pytest.raises(ValueError, match="poll_high_max_s"):
        LaneConfig(poll_high_max_s=1e-5)
    with pytest.raises(ValueError, match="deadline_s"):
        LaneConfig(deadline_s=0)
    with pytest.raises(ValueError, match="low_chunk_s"):
        LaneConfig(low_chunk_s=0)
    with pytest.raises(ValueError, match="low_chunk_min_bytes"):
        LaneConfig(low_chunk_min_bytes=2 << 20, low_chunk_max_bytes=1 << 20)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    gaps=st.lists(st.booleans(), min_size=12, max_size=12),
    chunk=st.integers(1, 256),
)
def test_chunking_moves_every_byte_exactly_once(lengths, gaps, chunk):
    """Whatever the chunk size, the chunks replay the submitted src->dst byte mapping."""
    fake = FakeBackend(auto=True)
    config = LaneConfig(low_chunk_s=None, low_chunk_bytes=chunk, poll_max_s=1e-4)
    lanes = LaneScheduler(fake, config)
    lanes.register_source(SRC, SRC_LEN)
    lanes.register_destination("r", PEER, [(DST, 1 << 20)], lanes=[Lane.LOW])
    transfers, src, dst = [], SRC, DST
    for length, gap in zip(lengths, gaps, strict=False):
        transfers.append((src, dst, length))
        src += length + (7 if gap else 0)
        dst += length
    lanes.submit("r", Lane.LOW, transfers, last=True)
    assert lanes.wait("r", Lane.LOW, 5).state is StreamState.DONE
    assert lanes.close()
    expected = [(s + i, d + i) for s, d, n in transfers for i in range(n)]
    moved = [(t.src + i, t.dst + i) for b in fake.batches for t in b.transfers for i in range(t.length)]
    assert moved == expected
    assert all(b.nbytes <= chunk for b in fake.batches)
    assert lanes.stats().low.bytes == sum(lengths)


def test_unreachable_peer_fails_its_requests_only(fake):
    fake.unreachable.add("dead:1")
    lanes, _ = make(fake)
    grant(lanes, "lost", 0, 64 * KIB, peer="dead:1")
    grant(lanes, "lost-idle", 0, 64 * KIB, peer="dead:1")
    grant(lanes, "kept", 0, 64 * KIB, lanes=[Lane.HIGH])
    lanes.submit("lost", Lane.HIGH, [(SRC, DST, 16)], last=True)
    status = lanes.wait("lost", Lane.HIGH, 5)
    assert (status.state, status.error) == (StreamState.FAILED, "peer dead:1 unreachable")
    assert lanes.status("lost-idle", Lane.LOW).state is StreamState.FAILED
    fake.auto = True
    lanes.submit("kept", Lane.HIGH, [(SRC, DST, 16)], last=True)
    assert lanes.wait("kept", Lane.HIGH, 5).state is StreamState.DONE
    assert [b.peer for b in fake.batches] == [PEER]
    assert lanes.close()


def test_a_peer_whose_write_failed_is_probed_again_before_its_next_write(fake):
    """A session name (host:port) outlives the process behind it: once a write to it failed
    (the peer died), a new process may take the name, and a frozen one must not get writes
    it would keep in the engine forever. So the name is probed again, as a new peer is."""
    lanes, _ = make(fake)
    grant(lanes, "first", 0, 64 * KIB, lanes=[Lane.HIGH])
    lanes.submit("first", Lane.HIGH, [(SRC, DST, 16)], last=True)
    (batch,) = fake.wait_batches(1)
    fake.resolve(batch, BatchState.FAILED)
    assert lanes.wait("first", Lane.HIGH, 5).state is StreamState.FAILED
    fake.unreachable.add(PEER)  # what now answers to the name does not
    grant(lanes, "second", 64 * KIB, 64 * KIB, lanes=[Lane.HIGH])
    lanes.submit("second", Lane.HIGH, [(SRC, DST + 64 * KIB, 16)], last=True)
    status = lanes.wait("second", Lane.HIGH, 5)
    assert (status.state, status.error) == (StreamState.FAILED, f"peer {PEER} unreachable")
    assert len(fake.batches) == 1
    assert fake.probes == [PEER, PEER]
    lanes.release("second")
    assert lanes.close()


def test_low_chunks_are_sized_from_the_measured_drain_rate(fake):
    # min == max: once any rate is measured the chunk size is pinned, whatever the timing.
    lanes, _ = make(
        fake,
        low_inflight=1,
        low_chunk_s=2e-3,
        low_chunk_bytes=64 * KIB,
        low_chunk_min_bytes=100 * KIB,
        low_chunk_max_bytes=100 * KIB,
    )
    grant(lanes, "r", 0, 1024 * KIB, lanes=[Lane.LOW])
    lanes.submit("r", Lane.LOW, [(SRC, DST, 400 * KIB)], last=True)
    sizes = []
    for n in range(1, 5):
        batch = fake.wait_batches(n)[-1]
        sizes.append(batch.nbytes // KIB)
        fake.resolve(batch)
    assert sizes == [64, 100, 100, 100]  # unmeasured: low_chunk_bytes; then paced
    fake.drain()
    assert lanes.wait("r", Lane.LOW, 5).state is StreamState.DONE
    assert lanes.close()


def test_high_writes_a_slow_peer_cannot_land_soon_are_polled_sparingly(fake):
    """On a slow link HIGH writes stay in the engine for seconds (an Anchor sent layer by
    layer during prefill's forward): the driver sleeps by the peer's measured drain rate,
    up to ``poll_high_max_s``, instead of polling every ``poll_high_s``; a landing is
    still noticed."""
    lanes, _ = make(fake, poll_high_max_s=5e-3)
    grant(lanes, "r", 0, 1024 * KIB, lanes=[Lane.HIGH])
    lanes.submit("r", Lane.HIGH, [(SRC, DST, KIB)], last=False)
    (first,) = fake.wait_batches(1)
    time.sleep(0.02)
    fake.resolve(first)  # 1 KiB in >= 20 ms: the peer drains < 52 KB/s
    fake.let_driver_cycle(first, 1)
    lanes.submit("r", Lane.HIGH, [(SRC + KIB, DST + KIB, 64 * KIB)], last=True)
    second = fake.wait_batches(2)[1]
    fake.let_driver_cycle(second, 1)
    polls = second.polls
    time.sleep(0.1)  # 64 KiB take > 1.2 s at that rate: the driver sleeps 5 ms a poll
    assert second.polls - polls <= 0.1 / 5e-3 + 2
    fake.resolve(second)
    assert lanes.wait("r", Lane.HIGH, 5).state is StreamState.DONE
    assert lanes.close()
