"""The lanes' priority rule and deadlines (``lynx.lanes.queues``) on their own: no driver
thread, no engine, no lock."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from lynx.lanes import Lane, LaneConfig, StreamState, Transfer
from lynx.lanes.queues import Deadlines, LaneRequest, LaneStream, Part, PeerLanes, Planner
from lynx.lanes.ranges import AddressError, AddressRanges
from lynx.lanes.stats import LaneRecorder

KIB = 1024


def request(peer: PeerLanes, request_id: str = "r", timeout_s: float = 30.0) -> LaneRequest:
    req = LaneRequest(request_id, peer, AddressRanges.union([(0, 1 << 30)]), timeout_s)
    req.streams = {lane: LaneStream(req, lane) for lane in Lane}
    return req


def queue(req: LaneRequest, lane: Lane, nbytes: int, at: int = 0) -> Part:
    stream = req.streams[lane]
    stream.move(StreamState.OPEN)
    part = Part(stream, deque([Transfer(at, at, nbytes)]), 0.0, nbytes)
    req.peer.queues[lane].append(part)
    return part


def planner(**config: float | int | None) -> Planner:
    return Planner(LaneConfig(**config), {lane: LaneRecorder() for lane in Lane})  # type: ignore[arg-type]


def opened_peer() -> PeerLanes:
    peer = PeerLanes("peer", threading.Lock())
    peer.opened = True
    return peer


def test_high_goes_whole_and_first_and_holds_low_back_while_in_the_engine() -> None:
    peer = opened_peer()
    req = request(peer)
    queue(req, Lane.LOW, 4 * KIB)
    queue(req, Lane.HIGH, 3 * KIB, at=1 << 20)
    plan, probe = planner(low_chunk_s=None, low_chunk_bytes=KIB).plan([peer], 0.0)
    assert not probe
    assert [(c.stream.lane, c.nbytes) for c in plan] == [(Lane.HIGH, 3 * KIB)]
    assert peer.in_engine[Lane.HIGH] == 1 and req.chunks_in_engine == 1
    assert planner().plan([peer], 0.0) == ([], [])  # LOW waits while HIGH is in the engine


def test_low_leaves_in_chunks_at_most_low_inflight_at_a_time() -> None:
    peer = opened_peer()
    part = queue(request(peer), Lane.LOW, 5 * KIB)
    rule = planner(low_chunk_s=None, low_chunk_bytes=2 * KIB, low_inflight=2)
    plan, _ = rule.plan([peer], 0.0)
    assert [c.nbytes for c in plan] == [2 * KIB, 2 * KIB]
    assert [c.transfers[0].src for c in plan] == [0, 2 * KIB]  # cut from the part's front, in order
    assert list(part.transfers) == [Transfer(4 * KIB, 4 * KIB, KIB)] and peer.queues[Lane.LOW]
    peer.in_engine[Lane.LOW] = 1  # one landed
    (last,) = rule.plan([peer], 0.0)[0]
    assert last.nbytes == KIB and not peer.queues[Lane.LOW]


def test_a_peer_not_opened_is_probed_once_and_gets_no_write() -> None:
    peer = PeerLanes("new", threading.Lock())
    queue(request(peer), Lane.HIGH, KIB)
    rule = planner()
    assert rule.plan([peer], 0.0) == ([], [peer])
    assert peer.probing and rule.plan([peer], 0.0) == ([], [])


def test_a_write_outside_the_grants_or_sources_is_refused_and_neighbours_merge() -> None:
    peer = opened_peer()
    req = LaneRequest("r", peer, AddressRanges.union([(0, 8 * KIB)]), 30.0)
    sources = AddressRanges.union([(1 << 20, 8 * KIB)])
    merged = req.validated([Transfer(1 << 20, 0, KIB), Transfer((1 << 20) + KIB, KIB, KIB)], sources)
    assert merged == [Transfer(1 << 20, 0, 2 * KIB)]
    with pytest.raises(AddressError, match="outside the ranges granted"):
        req.validated([Transfer(1 << 20, 8 * KIB, 1)], sources)
    with pytest.raises(AddressError, match="outside every registered source"):
        req.validated([Transfer(0, 0, 1)], sources)


def test_deadlines_come_due_in_order_and_skip_settled_requests() -> None:
    peer = opened_peer()
    early, late, done = request(peer, "early", 1.0), request(peer, "late", 5.0), request(peer, "done", 0.5)
    for stream in done.streams.values():
        stream.move(StreamState.ABORTED)
    deadlines = Deadlines()
    for req in (late, done, early):
        deadlines.add(req)
    now = early.deadline - 1.0
    assert deadlines.until_next(now) == pytest.approx(1.0)  # the settled one's is not waited for
    assert deadlines.overdue(early.deadline) == [early]
    assert deadlines.overdue(late.deadline) == [late]
    assert deadlines.until_next(late.deadline) is None
    assert "deadline of 5 s passed" in late.overdue()
