"""Two priority lanes over a transfer engine that has none.

The engine has no priority: a small Anchor submitted behind a large Residual waits for
most of it. `LaneScheduler` keeps the Residual (LOW) in its own queue and feeds it to the
engine in chunks (sized to ~2 ms of link time at the peer's measured drain rate), a
bounded number at a time, and only while no Anchor (HIGH) work for that peer is queued or
in flight. HIGH work goes to the engine as soon as it is submitted. So a HIGH transfer
competes with at most `low_inflight` LOW chunks.

Threads: callers (`submit`, `abort`, ...) validate and queue under one lock; a single
driver thread plans what goes to the engine, polls it, enforces deadlines and runs the
`on_settled` callback. The engine's submit call itself runs on one submitter thread per
peer: it can block (the engine's first write to a peer opens it with a handshake on the
submitting thread; to a peer that froze after answering its probe that handshake blocked
until the peer died, measured), and a peer that blocks must stall neither the driver nor
the deadlines. A chunk handed to a submitter counts as in the engine from that
moment, so a deadline that passes while its submit blocks fails the request and `release`
still refuses until the engine has let go of it. The driver never spins: with transfers in
flight it sleeps on a condition variable between polls (exponential backoff from
`poll_min_s` to `poll_max_s`; while HIGH writes are in flight at most `poll_high_s`, or
an eighth of the time their peer's measured drain rate says they need; reset by any
progress, cut short by any `submit`); with none in flight it sleeps until the next
deadline or the next `submit`. It never calls the engine's sync APIs or batch wait, which
spin a core.

The driver survives its own failures: an exception in one pass fails every open request
(what the pass left half done cannot be trusted; writes already in the engine are still
polled to the end, so `release` stays truthful) and the driver goes on. If it stops
anyway, every open request fails, `submit` and `register_destination` raise `LaneError`,
and `SchedulerStats.driver_alive` says so, instead of transfers hanging silently.

Units of work: a *stream* is one request's bytes on one lane (the Anchor stream, the
Residual stream). It may be fed by several `submit` calls (one per prefill chunk, say) and
is done once the call marked `last=True` has been made and every byte submitted has landed.
Each call that submits bytes is a *part* of its stream: the engine may land a stream's
writes out of order (several chunks in flight), so `parts_landed` counts the parts whose
every byte landed together with every earlier part's, and `on_progress` reports each
advance of it that does not also settle the stream.

This module holds the threads and the lock; :mod:`lynx.lanes.queues` the bookkeeping
(streams, parts, peers' queues, deadlines) and the priority rule (:class:`Planner`),
without threads; :mod:`lynx.lanes.streams` the vocabulary callers use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from lynx.lanes.backend import BatchState, Transfer, TransferBackend
from lynx.lanes.queues import Deadlines, EngineChunk, LaneRequest, LaneStream, Part, PeerLanes, Planner
from lynx.lanes.ranges import AddressError, AddressRanges
from lynx.lanes.stats import LaneRecorder, SchedulerStats
from lynx.lanes.streams import (
    TERMINAL_STATES,
    Lane,
    LaneConfig,
    LaneError,
    StreamClosedError,
    StreamState,
    StreamStatus,
    check_deadline,
)

log = logging.getLogger(__name__)
_SUBMIT_RAISED = object()  # the handle of a chunk whose submit_write raised
_NOT_SUBMITTED = object()  # the handle of a chunk whose stream settled before its submit
_SUBMITTER_LINGER_S = 1.0  # an idle peer's submitter thread waits this long for more work
_DRIVER_ERROR_PAUSE_S = 0.05  # after a failed pass: a fault that repeats must not spin a core


class LaneScheduler:
    """Priority lanes for one process's outgoing writes. See the module docstring.

    `on_settled(status)` is called once per stream when it reaches a terminal state, from
    the driver thread, without the scheduler's lock held: keep it short (it delays the
    lanes); it may call back into the scheduler. `on_progress(status)` likewise, when an
    open stream's `parts_landed` advances (before its `on_settled`, in order).
    """

    def __init__(
        self,
        backend: TransferBackend,
        config: LaneConfig | None = None,
        on_settled: Callable[[StreamStatus], None] | None = None,
        on_progress: Callable[[StreamStatus], None] | None = None,
    ) -> None:
        self._backend = backend
        self._config = config or LaneConfig()
        self._on_settled = on_settled
        self._on_progress = on_progress
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # driver: new work or events
        self._settle = threading.Condition(self._lock)  # waiters: some stream settled
        self._sources = AddressRanges()
        self._requests: dict[str, LaneRequest] = {}
        self._peers: dict[str, PeerLanes] = {}
        self._deadlines = Deadlines()
        self._events: list[StreamStatus] = []
        self._recorders = {lane: LaneRecorder() for lane in Lane}
        self._planner = Planner(self._config, self._recorders)
        self._polls = 0
        self._closing = False
        self._abandon = False
        self._driver_cpu_at_exit = 0.0
        self._driver_errors = 0
        self._driver_stopped: str | None = None  # why the driver thread ended
        self._driver = threading.Thread(target=self._run, name="lynx-lanes", daemon=True)
        self._driver.start()

    # ---- memory -------------------------------------------------------------------------

    def register_source(self, addr: int, length: int) -> None:
        """Register a local buffer with the engine; transfers may only read from these."""
        with self._lock:
            self._sources.add(addr, length)
        try:
            self._backend.register_memory(addr, length)
        except BaseException:
            with self._lock:
                self._sources.remove(addr)
            raise

    def unregister_source(self, addr: int) -> None:
        """Unregister a source buffer; refused while any write is queued or in the engine."""
        with self._lock:
            for peer in self._peers.values():
                if any(peer.queues.values()) or any(peer.in_engine.values()):
                    raise LaneError(f"source 0x{addr:x} may still be read: writes pending")
            self._sources.remove(addr)
        self._backend.unregister_memory(addr)

    # ---- requests -----------------------------------------------------------------------

    def register_destination(
        self,
        request_id: str,
        peer: str,
        ranges: Iterable[tuple[int, int]],
        *,
        lanes: Iterable[Lane] = (Lane.HIGH, Lane.LOW),
        deadline_s: float | None = None,
    ) -> None:
        """Declare a request: its peer, the peer's (addr, length) spans granted to it, the
        lanes it will use, and how long (from now) all of them may take before it fails."""
        grants = AddressRanges.union(ranges)
        if not len(grants):
            raise AddressError(f"request {request_id!r}: no destination ranges granted")
        timeout = self._config.deadline_s if deadline_s is None else deadline_s
        check_deadline(timeout, f"request {request_id!r}: deadline_s")
        with self._lock:
            self._check_open()
            if request_id in self._requests:
                raise LaneError(f"request {request_id!r} is already registered")
            peer_state = self._peers.get(peer)
            if peer_state is None:
                peer_state = self._peers[peer] = PeerLanes(peer, self._lock)
            request = LaneRequest(request_id, peer_state, grants, timeout)
            request.streams = {Lane(lane): LaneStream(request, Lane(lane)) for lane in lanes}
            if not request.streams:
                raise ValueError(f"request {request_id!r}: no lanes")
            self._requests[request_id] = request
            self._deadlines.add(request)
            self._wake.notify()

    def submit(
        self,
        request_id: str,
        lane: Lane,
        transfers: Iterable[tuple[int, int, int]],
        *,
        last: bool,
    ) -> None:
        """Queue writes `(src, dst, length)` on the request's `lane` stream.

        Every transfer must read inside one registered source buffer and write inside the
        request's granted ranges, else `AddressError` and nothing is queued. Raises
        `StreamClosedError` once the stream got `last=True` or settled (a failure or abort
        can settle it at any time: callers producing bytes should expect that).
        """
        try:
            batch = [Transfer(*t) for t in transfers]
        except TypeError as e:
            raise AddressError(f"transfers must be (src, dst, length) triples: {e}") from None
        with self._lock:
            self._check_open()
            stream = self._stream(request_id, lane)
            if stream.last_seen or stream.state in TERMINAL_STATES:
                raise StreamClosedError(
                    f"request {request_id!r} {stream.lane.name}: stream is {stream.state.value}"
                    + (" and got last=True" if stream.last_seen else "")
                )
            coalesced = stream.request.validated(batch, self._sources)
            now = time.monotonic()
            nbytes = sum(t.length for t in coalesced)
            if stream.state is StreamState.IDLE:
                stream.move(StreamState.OPEN)
            stream.bytes_submitted += nbytes
            if last:
                stream.last_seen = True
                stream.last_submit_at = now
            if coalesced:
                item = Part(stream, deque(coalesced), now, nbytes)
                stream.unlanded.append(item)
                stream.request.peer.queues[stream.lane].append(item)
                self._wake.notify()
            elif last and stream.bytes_done == stream.bytes_submitted:
                self._settle_stream(stream, StreamState.DONE, None, now)

    def abort(self, request_id: str) -> bool:
        """Stop a request: drop its queued writes, settle its open streams as ABORTED.

        Writes already in the engine cannot be recalled and may still land; `release`
        tells when they are over. Returns False if every stream had already settled.
        """
        with self._lock:
            request = self._request(request_id)
            if request.settled():
                return False
            self._end_request(request, StreamState.ABORTED, "aborted", time.monotonic())
            return True

    def status(self, request_id: str, lane: Lane) -> StreamStatus:
        with self._lock:
            return self._stream(request_id, lane).status()

    def wait(self, request_id: str, lane: Lane, timeout: float | None = None) -> StreamStatus:
        """Block until the stream settles; TimeoutError if it has not after `timeout` s."""
        with self._lock:
            stream = self._stream(request_id, lane)
            if not self._settle.wait_for(lambda: stream.state in TERMINAL_STATES, timeout):
                raise TimeoutError(f"request {request_id!r} {stream.lane.name} still open")
            return stream.status()

    def release(self, request_id: str) -> None:
        """Forget a settled request. Refused while the engine may still read its source
        bytes: staging buffers of a request may be reused once this has succeeded."""
        with self._lock:
            request = self._request(request_id)
            if not request.settled():
                raise LaneError(f"request {request_id!r} has open streams: abort it first")
            if request.chunks_in_engine:
                raise LaneError(
                    f"request {request_id!r}: {request.chunks_in_engine} writes still in the "
                    "engine (a frozen peer keeps them there)"
                )
            del self._requests[request_id]

    def stats(self) -> SchedulerStats:
        with self._lock:
            high, low = (self._recorders[lane].snapshot() for lane in Lane)
            polls = self._polls
            errors, stopped = self._driver_errors, self._driver_stopped
        return SchedulerStats(
            high=high,
            low=low,
            driver_cpu_s=self._driver_cpu(),
            polls=polls,
            driver_alive=stopped is None,
            driver_errors=errors,
        )

    def _driver_cpu(self) -> float:
        ident = self._driver.ident
        if ident is not None and self._driver.is_alive():
            try:
                return time.clock_gettime(time.pthread_getcpuclockid(ident))
            except OSError:
                pass  # the driver exited since is_alive(): its final figure is recorded
        return self._driver_cpu_at_exit

    def close(self, timeout: float = 5.0) -> bool:
        """Abort every open request and stop the driver once the engine holds none of our
        writes. Returns False if some were still in the engine after `timeout` s (the
        driver then stops polling them)."""
        with self._lock:
            self._closing = True
            now = time.monotonic()
            for request in self._requests.values():
                if not request.settled():
                    self._end_request(request, StreamState.ABORTED, "scheduler closed", now)
            self._wake.notify()
        self._driver.join(timeout)
        drained = not self._driver.is_alive()
        if not drained:
            with self._lock:
                self._abandon = True
                self._wake.notify()
            self._driver.join(timeout)
        return drained

    def __enter__(self) -> LaneScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- caller-side helpers (lock held) --------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise LaneError("scheduler is closed")
        if self._driver_stopped is not None:
            raise LaneError(f"lanes driver stopped ({self._driver_stopped}): no transfer can move")

    def _request(self, request_id: str) -> LaneRequest:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _stream(self, request_id: str, lane: Lane) -> LaneStream:
        request = self._request(request_id)
        try:
            return request.streams[Lane(lane)]
        except (KeyError, ValueError):
            name = lane.name if isinstance(lane, Lane) else repr(lane)
            raise LaneError(f"request {request_id!r} has no {name} lane") from None

    def _settle_stream(self, stream: LaneStream, state: StreamState, error: str | None, now: float) -> None:
        stream.move(state)
        stream.error = error
        recorder = self._recorders[stream.lane]
        if state is StreamState.DONE:
            recorder.streams_done += 1
            recorder.completion_latencies.append(now - stream.last_submit_at)
        elif state is StreamState.FAILED:
            recorder.streams_failed += 1
        else:
            recorder.streams_aborted += 1
        self._events.append(stream.status())
        self._settle.notify_all()
        self._wake.notify()

    def _end_request(self, request: LaneRequest, state: StreamState, error: str, now: float) -> None:
        """Settle every open stream of `request` as `state`, drop its queued writes."""
        for stream in request.streams.values():
            if stream.state not in TERMINAL_STATES:
                self._settle_stream(stream, state, error, now)
        peer = request.peer
        for lane, queue in peer.queues.items():
            peer.queues[lane] = deque(i for i in queue if i.stream.request is not request)

    # ---- driver ---------------------------------------------------------------------------

    def _run(self) -> None:
        why = "closed"
        try:
            self._drive()
        except BaseException as exc:  # the thread ends here: reported below, not re-raised
            why = f"{type(exc).__name__}: {exc}"
            log.exception("lanes: driver stopped")
        finally:
            self._driver_cpu_at_exit = time.thread_time()
            with self._lock:
                self._driver_stopped = why
                self._fail_unsettled(f"lanes driver stopped ({why})")
                events, self._events = self._events, []
            for status in events:
                self._notify(status)

    def _fail_unsettled(self, error: str) -> None:
        now = time.monotonic()
        for request in self._requests.values():
            if not request.settled():
                self._end_request(request, StreamState.FAILED, error, now)

    def _drive(self) -> None:
        in_engine: list[EngineChunk] = []
        backoff = self._config.poll_min_s
        while True:
            try:
                stop, backoff = self._drive_once(in_engine, backoff)
            except Exception as exc:
                log.exception("lanes: driver pass failed; failing the requests it was moving")
                with self._lock:
                    self._driver_errors += 1
                    self._recount_in_engine(in_engine)
                    self._fail_unsettled(f"lanes driver error: {type(exc).__name__}: {exc}")
                    self._wake.wait(_DRIVER_ERROR_PAUSE_S)
                continue
            if stop:
                return

    def _drive_once(self, in_engine: list[EngineChunk], backoff: float) -> tuple[bool, float]:
        """One pass: expire, plan, hand over to the submitters, poll, apply; returns (stop, next backoff).
        ``in_engine`` (the chunks the engine holds) is updated in place, so a pass that
        raises loses none of them."""
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            plan, to_probe = self._planner.plan(self._peers.values(), now)
            self._hand_over(plan)
            in_engine.extend(plan)  # counted from the hand-over on, whatever this pass does next
            events, self._events = self._events, []
            stop = self._abandon or (self._closing and not in_engine)
            if not (plan or to_probe or events or stop):
                if in_engine:
                    high = any(chunk.stream.lane is Lane.HIGH for chunk in in_engine)
                    if high:
                        self._wake.wait(
                            max(min(backoff, self._config.poll_high_s), self._planner.high_poll_s(in_engine))
                        )
                    else:
                        self._wake.wait(backoff)
                    backoff = min(2 * backoff, self._config.poll_max_s)
                else:
                    self._wake.wait(self._deadlines.until_next(now))
        for status in events:
            self._notify(status)
        if stop:
            return True, backoff
        for peer in to_probe:
            threading.Thread(target=self._probe, args=(peer,), daemon=True).start()
        resolved = []
        pending = []
        for chunk in in_engine:
            state = self._poll(chunk)
            (pending if state is BatchState.PENDING else resolved).append((chunk, state))
        in_engine[:] = [chunk for chunk, _ in pending]
        if plan or resolved:
            backoff = self._config.poll_min_s
        with self._lock:
            self._polls += len(pending) + len(resolved)
            if resolved:
                self._apply(resolved, time.monotonic())
        return False, backoff

    def _recount_in_engine(self, in_engine: list[EngineChunk]) -> None:
        """After a failed pass: the per-peer and per-request counts of writes in the
        engine are what ``in_engine`` holds (a pass may have stopped between counting a
        chunk and handing it over), so no peer's LOW lane stays blocked by a lost count."""
        for peer in self._peers.values():
            peer.in_engine = dict.fromkeys(Lane, 0)
        for request in self._requests.values():
            request.chunks_in_engine = 0
        for chunk in in_engine:
            chunk.stream.request.peer.in_engine[chunk.stream.lane] += 1
            chunk.stream.request.chunks_in_engine += 1

    def _hand_over(self, plan: list[EngineChunk]) -> None:
        """Queue planned chunks on their peers' submitters, starting those not running."""
        for chunk in plan:
            peer = chunk.stream.request.peer
            peer.outbox.append(chunk)
            if peer.submitter is None:
                peer.submitter = threading.Thread(
                    target=self._submit_for, args=(peer,), name="lynx-lanes-submit", daemon=True
                )
                peer.submitter.start()
            else:
                peer.outbox_filled.notify()

    def _submit_for(self, peer: PeerLanes) -> None:
        """Submitter thread of one peer: hands its chunks to the engine in plan order, then
        lingers a while for more before it ends."""
        while True:
            with self._lock:
                if not peer.outbox:
                    peer.outbox_filled.wait(_SUBMITTER_LINGER_S)
                if not peer.outbox:
                    peer.submitter = None
                    return
                chunk = peer.outbox.popleft()
                settled = chunk.stream.state is not StreamState.OPEN
            # A chunk of a failed or aborted request is not sent at all: behind a blocked
            # submit, its request may have failed by its deadline.
            handle = _NOT_SUBMITTED if settled else self._submit(chunk)
            with self._lock:
                chunk.handle = handle
                self._wake.notify()

    def _submit(self, chunk: EngineChunk) -> object:
        try:
            return self._backend.submit_write(chunk.stream.request.peer.session, chunk.transfers)
        except Exception:
            log.exception("lanes: submit_write to %s raised", chunk.stream.request.peer.session)
            return _SUBMIT_RAISED

    def _poll(self, chunk: EngineChunk) -> BatchState:
        if chunk.handle is None:  # its submit has not returned yet
            return BatchState.PENDING
        if chunk.handle is _SUBMIT_RAISED:
            return BatchState.FAILED
        if chunk.handle is _NOT_SUBMITTED:
            return BatchState.DONE  # resolved: nothing of it reached the engine
        try:
            return self._backend.poll(chunk.handle)
        except Exception:
            log.exception("lanes: polling a write to %s raised", chunk.stream.request.peer.session)
            return BatchState.FAILED

    def _probe(self, peer: PeerLanes) -> None:
        """Helper thread: may block as long as the peer does not answer."""
        try:
            reachable = self._backend.probe(peer.session)
        except Exception:
            log.exception("lanes: probing %s raised", peer.session)
            reachable = False
        with self._lock:
            peer.probing = False
            peer.opened = reachable
            if not reachable:
                now = time.monotonic()
                for request in self._requests.values():
                    if request.peer is peer and not request.settled():
                        self._end_request(
                            request, StreamState.FAILED, f"peer {peer.session} unreachable", now
                        )
            self._wake.notify()

    def _notify(self, status: StreamStatus) -> None:
        """Hand an event to its callback: a settled stream's, or an open one's progress."""
        callback = self._on_settled if status.state in TERMINAL_STATES else self._on_progress
        if callback is None:
            return
        try:
            callback(status)
        except Exception:
            log.exception("lanes callback raised for %s", status)

    def _expire(self, now: float) -> None:
        for request in self._deadlines.overdue(now):
            self._end_request(request, StreamState.FAILED, request.overdue(), now)

    def _apply(self, resolved: list[tuple[EngineChunk, BatchState]], now: float) -> None:
        landed: dict[PeerLanes, int] = {}
        for chunk, state in resolved:
            stream = chunk.stream
            request = stream.request
            request.peer.in_engine[stream.lane] -= 1
            request.chunks_in_engine -= 1
            if chunk.handle is _NOT_SUBMITTED:
                continue  # never reached the engine: no bytes, no sign of the peer's health
            recorder = self._recorders[stream.lane]
            landed.setdefault(request.peer, 0)
            if state is BatchState.DONE:
                landed[request.peer] += chunk.nbytes
                recorder.bytes += chunk.nbytes
                recorder.chunks += 1
            else:
                recorder.chunks_failed += 1
                # The peer may have died, and a new process may take its session name
                # (host:port): probe that name again before its next write, as a new peer.
                request.peer.opened = False
            if stream.state is not StreamState.OPEN:
                continue  # the request was aborted or failed while this write was in flight
            if state is BatchState.DONE:
                stream.bytes_done += chunk.nbytes
                chunk.item.remaining -= chunk.nbytes
                progressed = stream.count_landed_parts()
                if stream.last_seen and stream.bytes_done == stream.bytes_submitted:
                    self._settle_stream(stream, StreamState.DONE, None, now)
                elif progressed and self._on_progress is not None:
                    self._events.append(stream.status())
            else:
                self._end_request(
                    request,
                    StreamState.FAILED,
                    f"{stream.lane.name} write to {request.peer.session} failed in the engine",
                    now,
                )
        for peer, nbytes in landed.items():
            peer.drain.landed(nbytes, now, busy=any(peer.in_engine.values()))
