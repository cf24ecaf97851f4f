"""The lanes' bookkeeping and their priority rule, without threads or an engine.

A request's bytes on one lane are a :class:`LaneStream`; each ``submit`` call that carries
bytes is a :class:`Part`, queued on its peer's lane (:class:`PeerLanes`) until the planner
cuts it into :class:`EngineChunk` batches for the engine. :class:`Planner` holds the rule:
any HIGH part goes to the engine whole, at once; LOW goes in chunks of about
``low_chunk_s`` of link time at the peer's measured drain rate, at most ``low_inflight``
at a time, and only while the peer has no HIGH write in the engine. Everything here is
called with the scheduler's lock held.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lynx.lanes.backend import Transfer
from lynx.lanes.pacing import DrainRate
from lynx.lanes.ranges import AddressError, AddressRanges, check_span
from lynx.lanes.stats import LaneRecorder
from lynx.lanes.streams import (
    STREAM_TRANSITIONS,
    TERMINAL_STATES,
    Lane,
    LaneConfig,
    StreamState,
    StreamStatus,
)

_HIGH_POLL_FRACTION = 1 / 8  # of a peer's expected drain time, the driver's sleep (poll_high_max_s)


class LaneStream:
    def __init__(self, request: LaneRequest, lane: Lane) -> None:
        self.request = request
        self.lane = lane
        self.state = StreamState.IDLE
        self.bytes_submitted = 0
        self.bytes_done = 0
        self.unlanded: deque[Part] = deque()  # its parts not wholly landed, oldest first
        self.parts_landed = 0
        self.last_seen = False
        self.last_submit_at = 0.0
        self.error: str | None = None

    def status(self) -> StreamStatus:
        return StreamStatus(
            self.request.request_id,
            self.lane,
            self.state,
            self.bytes_submitted,
            self.bytes_done,
            self.error,
            self.parts_landed,
        )

    def count_landed_parts(self) -> bool:
        """Count the parts at the head of :attr:`unlanded` that landed; whether any did."""
        landed = self.parts_landed
        while self.unlanded and not self.unlanded[0].remaining:
            self.unlanded.popleft()
            self.parts_landed += 1
        return self.parts_landed > landed

    def move(self, state: StreamState) -> None:
        if state not in STREAM_TRANSITIONS[self.state]:
            raise AssertionError(f"stream {self.state.value} -> {state.value} is not allowed")
        self.state = state


class LaneRequest:
    def __init__(self, request_id: str, peer: PeerLanes, grants: AddressRanges, timeout_s: float) -> None:
        self.request_id = request_id
        self.peer = peer
        self.grants = grants
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.streams: dict[Lane, LaneStream] = {}
        self.chunks_in_engine = 0  # the engine may still read this request's source bytes

    def settled(self) -> bool:
        return all(s.state in TERMINAL_STATES for s in self.streams.values())

    def validated(self, batch: Sequence[Transfer], sources: AddressRanges) -> list[Transfer]:
        """Check every transfer against sources and grants; merge contiguous neighbours."""
        merged: list[Transfer] = []
        for i, t in enumerate(batch):
            what = f"request {self.request_id!r} transfer #{i}"
            check_span(f"{what} source", t.src, t.length)
            check_span(f"{what} destination", t.dst, t.length)
            if not sources.covers(t.src, t.length):
                raise AddressError(f"{what} reads 0x{t.src:x}+{t.length}, outside every registered source")
            if not self.grants.covers(t.dst, t.length):
                raise AddressError(
                    f"{what} writes 0x{t.dst:x}+{t.length} on {self.peer.session}, "
                    "outside the ranges granted to this request"
                )
            prev = merged[-1] if merged else None
            if (
                prev is not None
                and prev.src + prev.length == t.src
                and prev.dst + prev.length == t.dst
                and sources.covers(prev.src, prev.length + t.length)
            ):
                merged[-1] = Transfer(prev.src, prev.dst, prev.length + t.length)
            else:
                merged.append(t)
        return merged

    def overdue(self) -> str:
        """The deadline error, saying where each open stream stood: an operator must tell a
        stream whose last bytes never came from one whose writes the engine never finished."""
        queued = {lane: 0 for lane in Lane}
        for lane, queue in self.peer.queues.items():
            queued[lane] = sum(1 for item in queue if item.stream.request is self)
        where = []
        for lane, stream in self.streams.items():
            if stream.state in TERMINAL_STATES:
                continue
            where.append(
                f"{lane.name}: {stream.bytes_done} of {stream.bytes_submitted} bytes landed, "
                f"{queued[lane]} queued, "
                + ("last part submitted" if stream.last_seen else "last part not submitted yet")
            )
        return (
            f"deadline of {self.timeout_s:g} s passed ({'; '.join(where)}; "
            f"{self.chunks_in_engine} write(s) in the engine)"
        )


@dataclass
class Part:
    """The transfers of one `submit` call (a part of its stream), waiting in a peer's lane
    queue; ``remaining``: its bytes not landed yet (queued or in the engine)."""

    stream: LaneStream
    transfers: deque[Transfer]
    enqueued_at: float
    remaining: int


@dataclass
class EngineChunk:
    """One batch handed to the engine; belongs to exactly one stream."""

    stream: LaneStream
    item: Part  # the part it was cut from
    transfers: list[Transfer]
    nbytes: int
    handle: object = None  # set by the peer's submitter once the engine took the chunk


class PeerLanes:
    def __init__(self, session: str, lock: threading.Lock) -> None:
        self.session = session
        self.queues: dict[Lane, deque[Part]] = {lane: deque() for lane in Lane}
        self.in_engine: dict[Lane, int] = dict.fromkeys(Lane, 0)
        # The engine's first write to a peer opens it (a handshake) under a mutex that every
        # submit takes, for as long as the peer does not answer: a frozen peer would stall
        # all peers, forever. So a peer is probed first, on a helper thread, and gets writes
        # only once it has answered; again after a write to it failed.
        self.probing = False
        self.opened = False
        self.drain = DrainRate()
        # Chunks planned for this peer, waiting for its submitter thread (None while none runs).
        self.outbox: deque[EngineChunk] = deque()
        self.submitter: threading.Thread | None = None
        self.outbox_filled = threading.Condition(lock)  # the scheduler's lock


class Deadlines:
    """The open requests by deadline, soonest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, LaneRequest]] = []
        self._seq = itertools.count()  # ties: first registered, first due

    def add(self, request: LaneRequest) -> None:
        heapq.heappush(self._heap, (request.deadline, next(self._seq), request))

    def until_next(self, now: float) -> float | None:
        """Seconds until the soonest deadline of a request still open; None: none is."""
        while self._heap and self._heap[0][2].settled():
            heapq.heappop(self._heap)
        return max(0.0, self._heap[0][0] - now) if self._heap else None

    def overdue(self, now: float) -> list[LaneRequest]:
        """Take the requests still open whose deadline passed by ``now``."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            request = heapq.heappop(self._heap)[2]
            if not request.settled():
                due.append(request)
        return due


class Planner:
    """The priority rule (see the module docstring); ``recorders`` count each lane's queue
    delays."""

    def __init__(self, config: LaneConfig, recorders: dict[Lane, LaneRecorder]) -> None:
        self._config = config
        self._recorders = recorders

    def plan(self, peers: Iterable[PeerLanes], now: float) -> tuple[list[EngineChunk], list[PeerLanes]]:
        """Pick what goes to the engine now, and which new peers to probe first."""
        plan: list[EngineChunk] = []
        to_probe: list[PeerLanes] = []
        for peer in peers:
            if peer.opened:
                while (chunk := self._next_chunk(peer, now)) is not None:
                    plan.append(chunk)
            elif not peer.probing and any(peer.queues.values()):
                peer.probing = True
                to_probe.append(peer)
        return plan, to_probe

    def _next_chunk(self, peer: PeerLanes, now: float) -> EngineChunk | None:
        """The priority rule: any HIGH item, whole; else a LOW chunk, if the peer has no
        HIGH write in the engine and a free LOW slot."""
        high, low = peer.queues[Lane.HIGH], peer.queues[Lane.LOW]
        if high:
            item = high.popleft()
            return self._chunk(item, list(item.transfers), now)
        if not low or peer.in_engine[Lane.HIGH]:
            return None
        if peer.in_engine[Lane.LOW] >= self._config.low_inflight:
            return None
        item = low[0]
        chunk = self._chunk(item, self._cut(item), now)
        if not item.transfers:
            low.popleft()
        return chunk

    def _cut(self, item: Part) -> list[Transfer]:
        """Take up to one LOW chunk's worth of bytes from the front of a LOW item."""
        config = self._config
        budget = config.low_chunk_bytes
        if config.low_chunk_s is not None:
            budget = item.stream.request.peer.drain.chunk_bytes(
                config.low_chunk_s,
                config.low_chunk_bytes,
                config.low_chunk_min_bytes,
                config.low_chunk_max_bytes,
            )
        taken: list[Transfer] = []
        queue = item.transfers
        while queue and budget:
            t = queue.popleft()
            if t.length > budget:
                queue.appendleft(Transfer(t.src + budget, t.dst + budget, t.length - budget))
                t = Transfer(t.src, t.dst, budget)
            taken.append(t)
            budget -= t.length
        return taken

    def _chunk(self, item: Part, transfers: list[Transfer], now: float) -> EngineChunk:
        stream = item.stream
        stream.request.peer.in_engine[stream.lane] += 1
        stream.request.peer.drain.started(now)
        stream.request.chunks_in_engine += 1
        self._recorders[stream.lane].queue_delays.append(now - item.enqueued_at)
        return EngineChunk(stream, item, transfers, sum(t.length for t in transfers))

    def high_poll_s(self, in_engine: list[EngineChunk]) -> float:
        """(Lock held) The longest the driver may sleep with HIGH writes in the engine, by
        the drain rates of their peers (LaneConfig.poll_high_max_s); 0 if one is unmeasured."""
        queued: dict[PeerLanes, int] = {}
        for chunk in in_engine:
            peer = chunk.stream.request.peer
            queued[peer] = queued.get(peer, 0) + chunk.nbytes
        soonest = math.inf
        for chunk in in_engine:
            if chunk.stream.lane is Lane.HIGH:
                peer = chunk.stream.request.peer
                if not peer.drain.rate:  # unmeasured, or only failed writes (0 B/s)
                    return 0.0
                soonest = min(soonest, queued[peer] / peer.drain.rate)
        return min(soonest * _HIGH_POLL_FRACTION, self._config.poll_high_max_s)
