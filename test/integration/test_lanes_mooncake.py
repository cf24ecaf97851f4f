"""The lanes over two real Mooncake Transfer Engines: this process sends, peer processes
(`lynx.lanes.peer`) receive, over TCP on 127.0.0.1."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time

import pytest

from lynx.lanes import (
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
from lynx.lanes.mooncake import MooncakeBackend
from lynx.lanes.peer import PeerProcess, buffer_address, span_digest

pytestmark = pytest.mark.integration

MIB = 1 << 20
PAGE = 64 * 1024
SRC_SIZE = 160 * MIB
PEER_SIZE = 160 * MIB


class Sender:
    """The sending side: one engine, one random source buffer, one scheduler."""

    def __init__(self) -> None:
        self.backend = MooncakeBackend("127.0.0.1")
        self.buffer = mmap.mmap(-1, SRC_SIZE)
        for off in range(0, SRC_SIZE, 16 * MIB):
            self.buffer[off : off + 16 * MIB] = os.urandom(16 * MIB)
        self.view = memoryview(self.buffer)
        self.base = buffer_address(self.buffer)
        self.settled: list[StreamStatus] = []
        self.lock = threading.Lock()
        config = LaneConfig(low_chunk_bytes=MIB, low_inflight=2, deadline_s=20)
        self.lanes = LaneScheduler(self.backend, config, on_settled=self._record)
        self.lanes.register_source(self.base, SRC_SIZE)

    def _record(self, status: StreamStatus) -> None:
        with self.lock:
            self.settled.append(status)

    def order(self, request_ids: set[str]) -> list[tuple[str, Lane]]:
        with self.lock:
            return [(s.request_id, s.lane) for s in self.settled if s.request_id in request_ids]


@pytest.fixture(scope="module")
def sender():
    s = Sender()
    yield s
    s.lanes.close(timeout=5)


@pytest.fixture(scope="module")
def sessions_used() -> set[str]:
    return set()


@pytest.fixture
def peers(sessions_used):
    started: list[PeerProcess] = []

    def start() -> PeerProcess:
        # The module's one scheduler knows a peer by its session, host:port, the port drawn
        # from ~2,000: a new peer on the port of an earlier one would inherit "it answered
        # its probe", and a frozen one would get writes. Each peer is new to the lanes.
        while True:
            peer = PeerProcess("127.0.0.1", PEER_SIZE)
            if peer.session not in sessions_used:
                break
            peer.close()
        sessions_used.add(peer.session)
        started.append(peer)
        return peer

    yield start
    for p in started:
        p.close()


def scattered(sender, peer, src_off, dst_off, nbytes, rng) -> list[Transfer]:
    """`nbytes` of contiguous source written to shuffled PAGE-sized destination pages."""
    pages = list(range(nbytes // PAGE))
    rng.shuffle(pages)
    return [
        Transfer(sender.base + src_off + i * PAGE, peer.base + dst_off + p * PAGE, PAGE)
        for i, p in enumerate(pages)
    ]


def assert_landed(sender, peer, transfers) -> None:
    spans = [(t.dst - peer.base, t.length) for t in transfers]
    expected = [span_digest(sender.view, t.src - sender.base, t.length) for t in transfers]
    assert peer.digests(spans) == expected


def zero_digest(n: int) -> str:
    return span_digest(memoryview(bytes(n)), 0, n)


def test_many_requests_on_both_lanes_arrive_intact(sender, peers):
    peer = peers()
    rng = random.Random(4)
    lanes = sender.lanes
    anchor, residual, region = 4 * PAGE, 24 * PAGE, 2 * MIB
    plans = {}
    for r in range(24):
        rid = f"intact-{r}"
        lanes.register_destination(rid, peer.session, [(peer.base + r * region, region)])
        plans[rid] = (
            scattered(sender, peer, r * region, r * region, anchor, rng),
            scattered(sender, peer, r * region + anchor, r * region + anchor, residual, rng),
        )
    # Residual arrives in three parts per request (as prefill chunks would), interleaved.
    for part in range(3):
        for rid, (high, low) in plans.items():
            if part == 0:
                lanes.submit(rid, Lane.HIGH, high, last=True)
            third = len(low) // 3
            lanes.submit(rid, Lane.LOW, low[part * third : (part + 1) * third], last=part == 2)
    for rid, (high, low) in plans.items():
        for lane, transfers in ((Lane.HIGH, high), (Lane.LOW, low)):
            status = lanes.wait(rid, lane, timeout=30)
            nbytes = sum(t.length for t in transfers)
            parts = 1 if lane is Lane.HIGH else 3  # each submit a part, all landed in order
            assert status == StreamStatus(rid, lane, StreamState.DONE, nbytes, nbytes, None, parts)
        assert_landed(sender, peer, high + low)
        lanes.release(rid)


def test_high_completes_before_the_low_backlog(sender, peers):
    peer = peers()
    lanes = sender.lanes
    bulk = [f"bulk-{i}" for i in range(8)]
    for i, rid in enumerate(bulk):  # 8 x 16 MiB of Residual queued first
        off = i * 16 * MIB
        lanes.register_destination(rid, peer.session, [(peer.base + off, 16 * MIB)])
        lanes.submit(rid, Lane.LOW, [(sender.base + off, peer.base + off, 16 * MIB)], last=True)
    anchors = [f"anchor-{i}" for i in range(4)]
    for i, rid in enumerate(anchors):
        off = 128 * MIB + i * MIB
        lanes.register_destination(rid, peer.session, [(peer.base + off, MIB)])
        lanes.submit(rid, Lane.HIGH, [(sender.base + off, peer.base + off, 256 * 1024)], last=True)
    for rid in anchors:
        assert lanes.wait(rid, Lane.HIGH, timeout=30).state is StreamState.DONE
    backlog_left = sum(16 * MIB - lanes.status(rid, Lane.LOW).bytes_done for rid in bulk)
    for rid in bulk:
        assert lanes.wait(rid, Lane.LOW, timeout=30).state is StreamState.DONE
    order = sender.order(set(bulk) | set(anchors))
    low_done = [i for i, (_, lane) in enumerate(order) if lane is Lane.LOW]
    high_done = [i for i, (_, lane) in enumerate(order) if lane is Lane.HIGH]
    assert max(high_done[:4]) < min(low_done), order
    assert backlog_left > 64 * MIB  # the anchors landed with most of the backlog still queued
    for i, rid in enumerate(bulk + anchors):
        off = i * 16 * MIB if i < 8 else 128 * MIB + (i - 8) * MIB
        n = 16 * MIB if i < 8 else 256 * 1024
        assert_landed(sender, peer, [Transfer(sender.base + off, peer.base + off, n)])
        lanes.abort(rid)  # the unused HIGH/LOW halves
        lanes.release(rid)


def test_abort_cancels_pending_work(sender, peers):
    peer = peers()
    lanes = sender.lanes
    lanes.register_destination("cancel", peer.session, [(peer.base, 64 * MIB)])
    lanes.submit("cancel", Lane.LOW, [(sender.base, peer.base, 64 * MIB)], last=True)
    assert lanes.abort("cancel")
    status = lanes.status("cancel", Lane.LOW)
    assert status.state is StreamState.ABORTED
    with pytest.raises(StreamClosedError):
        lanes.submit("cancel", Lane.LOW, [(sender.base, peer.base, 4096)], last=True)
    deadline = time.monotonic() + 10
    while True:  # release succeeds once the engine has let go of the in-flight chunks
        try:
            lanes.release("cancel")
            break
        except LaneError:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    # At most the chunks in flight at the abort landed; the rest never left.
    assert peer.digests([(32 * MIB, 32 * MIB)]) == [zero_digest(32 * MIB)]


def test_killed_peer_fails_its_requests_and_others_complete(sender, peers):
    doomed, healthy = peers(), peers()
    lanes = sender.lanes
    rng = random.Random(7)
    plans = {}
    for i in range(4):
        for name, peer in (("doomed", doomed), ("healthy", healthy)):
            rid = f"{name}-{i}"
            off = i * 32 * MIB
            lanes.register_destination(rid, peer.session, [(peer.base + off, 32 * MIB)])
            high = scattered(sender, peer, off, off, 4 * PAGE, rng)
            low = [Transfer(sender.base + off + MIB, peer.base + off + MIB, 24 * MIB)]
            lanes.submit(rid, Lane.HIGH, high, last=True)
            lanes.submit(rid, Lane.LOW, low, last=True)
            plans[rid] = (peer, high + low)
    while lanes.status("doomed-0", Lane.LOW).bytes_done == 0:
        time.sleep(0.001)
    killed_at = time.monotonic()
    doomed.kill()
    for rid, (peer, transfers) in plans.items():
        status = lanes.wait(rid, Lane.LOW, timeout=30)
        if peer is doomed:
            assert status.state is StreamState.FAILED, status
            # A write in the engine fails; a peer whose write failed is probed again before
            # its next one, and a dead one answers no probe.
            error = status.error or ""
            assert "failed in the engine" in error or error == f"peer {doomed.session} unreachable", error
        else:
            assert status.state is StreamState.DONE, status
            assert lanes.status(rid, Lane.HIGH).state is StreamState.DONE
            assert_landed(sender, peer, transfers)
    assert time.monotonic() - killed_at < 20  # well inside the 20 s deadline: detected


def test_frozen_peers_fail_by_deadline_and_others_complete(sender, peers):
    stalled, never_answered, healthy = peers(), peers(), peers()
    lanes = sender.lanes
    # `stalled` freezes after it was reached: its writes sit in the engine, pending.
    lanes.register_destination("warm-up", stalled.session, [(stalled.base, 4096)])
    lanes.submit("warm-up", Lane.HIGH, [(sender.base, stalled.base, 4096)], last=True)
    assert lanes.wait("warm-up", Lane.HIGH, timeout=30).state is StreamState.DONE
    stalled.freeze()
    # `never_answered` freezes before the first write: the probe of it never returns.
    never_answered.freeze()
    for rid, peer in (("stalled", stalled), ("never", never_answered), ("alive", healthy)):
        deadline = None if peer is healthy else 1
        lanes.register_destination(rid, peer.session, [(peer.base, 64 * MIB)], deadline_s=deadline)
        lanes.submit(rid, Lane.LOW, [(sender.base, peer.base, 64 * MIB)], last=True)
    for rid in ("stalled", "never"):
        status = lanes.wait(rid, Lane.LOW, timeout=30)
        assert status.state is StreamState.FAILED
        assert status.error is not None and status.error.startswith("deadline of 1 s passed (")
    assert lanes.wait("alive", Lane.LOW, timeout=30).state is StreamState.DONE
    assert_landed(sender, healthy, [Transfer(sender.base, healthy.base, 64 * MIB)])
    with pytest.raises(LaneError, match="still in the engine"):
        lanes.release("stalled")
    lanes.release("never")  # nothing of it ever reached the engine


def test_writes_outside_the_grant_never_reach_the_engine(sender, peers):
    peer = peers()
    lanes = sender.lanes
    lanes.register_destination("fenced", peer.session, [(peer.base, MIB)])
    outside = Transfer(sender.base, peer.base + 2 * MIB, 4096)  # the peer did register it
    with pytest.raises(AddressError, match="outside the ranges granted"):
        lanes.submit("fenced", Lane.HIGH, [(sender.base, peer.base, 4096), outside], last=True)
    with pytest.raises(AddressError, match="outside every registered source"):
        lanes.submit("fenced", Lane.HIGH, [(sender.base - 4096, peer.base, 4096)], last=True)
    assert lanes.status("fenced", Lane.HIGH).state is StreamState.IDLE
    assert peer.digests([(0, 4096), (2 * MIB, 4096)]) == [zero_digest(4096)] * 2
    # The engine itself would have written it: the check above is the only fence.
    handle = sender.backend.submit_write(peer.session, [outside])
    while (state := sender.backend.poll(handle)) is BatchState.PENDING:
        time.sleep(0.001)
    assert state is BatchState.DONE
    assert_landed(sender, peer, [outside])
    lanes.abort("fenced")
    lanes.release("fenced")


def wait_resolved(backend, handle) -> BatchState:
    while (state := backend.poll(handle)) is BatchState.PENDING:
        time.sleep(0.0005)
    return state


def test_backend_batch_is_done_only_when_every_part_landed(sender, peers):
    """The engine's status call looks at a batch's first entry only; ours must not."""
    peer = peers()
    parts = [
        Transfer(sender.base, peer.base, 4096),
        Transfer(sender.base + MIB, peer.base + MIB, 96 * MIB),
    ]
    handle = sender.backend.submit_write(peer.session, parts)
    assert wait_resolved(sender.backend, handle) is BatchState.DONE
    tail = Transfer(parts[1].src + parts[1].length - 4096, parts[1].dst + parts[1].length - 4096, 4096)
    assert_landed(sender, peer, [tail])  # at once: the last bytes of the last part are there
    assert_landed(sender, peer, parts)


def test_backend_batch_with_a_refused_part_fails_after_the_rest_resolved(sender, peers):
    peer = peers()
    good = Transfer(sender.base, peer.base, 32 * MIB)
    refused = Transfer(sender.base, peer.base + PEER_SIZE, 4096)  # past the peer's buffer
    handle = sender.backend.submit_write(peer.session, [good, refused])
    assert wait_resolved(sender.backend, handle) is BatchState.FAILED
    assert_landed(sender, peer, [good])
