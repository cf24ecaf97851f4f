"""Prefill side: encode each request's KV pages into a send buffer and send the Anchor on
the HIGH lane, the Residual on the LOW lane, to the space decode offered.

The server's scheduler calls :meth:`ProgressiveSender.add_chunk` for each chunk of a
request it would have sent as raw KV pages, and :meth:`pump` regularly; both run on the
scheduler thread, which owns the KV pool. A chunk is encoded as soon as the request has
send-buffer space; until then it waits (the request does not fail) and :meth:`holds_pages`
tells the server not to free the request's KV pages. Once encoded, the bytes live in the
send buffer and the KV pages are no longer needed.

Notices to decode (``ACCEPT``/``REJECT``/``LANDED``/``RELEASED``, see
:mod:`lynx.transfer.protocol`) go through the ``notify`` callable the server provides;
``LANDED`` is sent from the lanes' driver thread when a stream settles, ``RELEASED`` from
this object's reaper thread once the engine holds no more of the request's writes (only
then is its send-buffer space reused and decode told it may reuse its receive space).
The reaper thread also submits writes held back on purpose (``hold_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lynx.codec import CodecError, encode_pages
from lynx.lanes import Lane, LaneConfig, LaneError, LaneScheduler, StreamState, StreamStatus, TransferBackend
from lynx.transfer.arena import arena_over
from lynx.transfer.protocol import (
    Handshake,
    Notice,
    NoticeKind,
    Offer,
    ProtocolError,
    RequestLayout,
    Stream,
    parse_handshake,
)

log = logging.getLogger(__name__)

Endpoint = tuple[str, int]
_STREAM_OF_LANE = {Lane.HIGH: Stream.ANCHOR, Lane.LOW: Stream.RESIDUAL}
_LANE_OF_STREAM = {stream: lane for lane, stream in _STREAM_OF_LANE.items()}
_NO_OFFER = (
    "sent no Lynx offer: it runs without --lynx (start both servers with --lynx and the same --lynx-* flags)"
)
_ENDED_KEPT = 1 << 16  # failed or aborted rooms remembered, so that their late chunks are dropped


def page_slots(pages: np.ndarray | torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots (int64, CPU) of whole pages, in page order."""
    pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    if page_size == 1:
        return pages_t
    return (pages_t[:, None] * page_size + torch.arange(page_size)).reshape(-1)


@dataclass
class _Room:
    room: int
    peer: str  # the decode engine's session id
    endpoint: Endpoint  # where decode takes notices
    offer: Offer
    plan: RequestLayout
    pending: deque[tuple[torch.Tensor, bool]] = field(default_factory=deque)
    slots: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    segments_sent: int = 0
    offset: int | None = None  # of the request's space in the send buffer
    lanes: tuple[Lane, ...] = (Lane.HIGH, Lane.LOW)
    settled: set[Lane] = field(default_factory=set)
    closed: bool = False  # last chunk encoded, or the room failed
    failed: bool = False


@dataclass
class SenderStats:
    rooms: int
    waiting_for_space: int
    buffer_bytes: int
    buffer_used: int
    anchor_bytes: int
    residual_bytes: int


class ProgressiveSender:
    """See the module docstring. ``on_failure(room, reason)`` is called (on whichever
    thread found it) when a request's Lynx transfer fails, so the server can fail it."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        buffer: torch.Tensor,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        page_size: int,
        handshake: Handshake,
        lane_config: LaneConfig,
        notify: Callable[[Endpoint, list[bytes]], None],
        on_failure: Callable[[int, str], None],
        hold_s: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self._arena = arena_over(buffer, "send")
        self.handshake = handshake
        self._buffer = buffer
        self._k, self._v = list(k_buffers), list(v_buffers)
        self._page_size = page_size
        self._notify = notify
        self._on_failure = on_failure
        self._lock = threading.RLock()
        self._rooms: dict[int, _Room] = {}
        # room -> (decode's session, its control endpoint, the accepted offer) or the refusal
        self._answers: dict[int, tuple[str, Endpoint, Offer] | str] = {}
        self._releasing: set[int] = set()
        self._ended: OrderedDict[int, None] = OrderedDict()
        self._sent = {Stream.ANCHOR: 0, Stream.RESIDUAL: 0}
        self._hold_s = {Lane.HIGH: hold_s[0], Lane.LOW: hold_s[1]}
        # writes held back on purpose (hold_s): (due, room, lane, writes, last), in due order
        self._held: dict[Lane, deque[tuple[float, int, Lane, list[tuple[int, int, int]], bool]]] = {
            lane: deque() for lane in Lane
        }
        self._lanes = LaneScheduler(backend, lane_config, on_settled=self._on_settled)
        self._lanes.register_source(buffer.data_ptr(), buffer.numel())
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="lynx-sender-reaper", daemon=True)
        self._reaper.start()

    # ---- pairing (bootstrap thread) ---------------------------------------------------------

    def answer_offer(
        self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str
    ) -> Offer | str:
        """Check decode's offer for ``room`` (from its Mooncake ``session`` at control
        ``endpoint``), tell decode ACCEPT or REJECT, and remember the answer for
        :meth:`add_chunk`. Returns the offer, or why it was refused. ``offer_bytes`` None:
        decode runs without Lynx (it gets no notice, it would not understand one)."""
        answer = self._check_offer(room, offer_bytes, endpoint)
        with self._lock:
            self._answers[room] = answer if isinstance(answer, str) else (session, endpoint, answer)
        return answer

    def _check_offer(self, room: int, offer_bytes: bytes | None, endpoint: Endpoint) -> Offer | str:
        where = f"decode {endpoint[0]}:{endpoint[1]}"
        if offer_bytes is None:
            return f"{where} {_NO_OFFER}"
        reason = None
        try:
            offer = Offer.from_wire(offer_bytes)
            theirs = parse_handshake(offer.handshake)
            reason = self.handshake.mismatch(theirs, this="this prefill server", other=where)
        except ProtocolError as exc:
            reason = f"cannot read the decode server's Lynx offer: {exc}"
        if reason is not None:
            log.error("Lynx: refusing room %s: %s", room, reason)
            self._notify(endpoint, Notice(NoticeKind.REJECT, room, text=reason).to_frames())
            return reason
        self._notify(
            endpoint, Notice(NoticeKind.ACCEPT, room, handshake=self.handshake.to_wire()).to_frames()
        )
        return offer

    def refusal(self, room: int) -> str | None:
        """Why ``room`` cannot be sent with Lynx (no offer came, or it was refused); None
        once its offer was accepted."""
        with self._lock:
            answer = self._answers.get(room)
        if answer is None:
            return f"the decode server {_NO_OFFER}"
        return answer if isinstance(answer, str) else None

    def forget_offer(self, room: int) -> None:
        """The request is done on this side: drop its answer."""
        with self._lock:
            self._answers.pop(room, None)

    # ---- scheduler thread -------------------------------------------------------------------

    def add_chunk(self, room: int, pages: np.ndarray, last: bool) -> None:
        """Queue the request's next chunk (prefill page ids, in order) and pump. The room's
        offer must have been accepted (:meth:`refusal` is None)."""
        with self._lock:
            if room in self._ended:
                return  # its space on decode may already serve another request
            state = self._rooms.get(room)
            if state is None:
                answer = self._answers.get(room)
                if answer is None or isinstance(answer, str):
                    raise ValueError(f"room {room} has no accepted Lynx offer")
                peer, endpoint, offer = answer
                plan = RequestLayout.of(self.handshake, offer.n_tokens)
                if (offer.anchor_nbytes, offer.residual_nbytes) != (
                    plan.anchor_nbytes,
                    plan.sent_residual_nbytes,
                ):
                    self._fail(
                        room,
                        f"decode offered {offer.anchor_nbytes}+{offer.residual_nbytes} bytes "
                        f"for {offer.n_tokens} tokens, this side needs "
                        f"{plan.anchor_nbytes}+{plan.sent_residual_nbytes}",
                    )
                    return
                need = plan.encoded_nbytes
                if self._arena.rounded(need) > self._arena.capacity:  # it would hold up every later room
                    self._fail(
                        room,
                        f"{offer.n_tokens} tokens need {need} bytes of send buffer, it has "
                        f"{self._arena.capacity}: raise --lynx-buffer-bytes",
                    )
                    return
                lanes = tuple(_LANE_OF_STREAM[stream] for stream in plan.streams)
                state = _Room(room, peer, endpoint, offer, plan, lanes=lanes)
                self._rooms[room] = state
            if state.closed:
                return
            state.pending.append((page_slots(pages, self._page_size), last))
        self.pump()

    def pump(self) -> None:
        """Encode and send every queued chunk whose request has (or now gets) space."""
        with self._lock:
            for state in list(self._rooms.values()):
                if state.pending and not state.closed:
                    if state.offset is None and not self._start(state):
                        return  # first come, first served: later requests wait too
                    self._encode_pending(state)

    def holds_pages(self, room: int) -> bool:
        """True while some of the request's chunks are not encoded yet."""
        with self._lock:
            state = self._rooms.get(room)
            return state is not None and not state.closed and bool(state.pending)

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Stop the request's transfer (any thread); its space is reused once the engine
        holds none of its writes."""
        with self._lock:
            self._end(room)
            state = self._rooms.get(room)
            if state is None or (state.closed and len(state.settled) == len(state.lanes)):
                return
            state.closed = state.failed = True
            state.pending.clear()
            if state.offset is None:  # nothing was ever written: decode may reuse its space now
                del self._rooms[room]
                endpoint = state.endpoint
            else:
                endpoint = None
        if endpoint is not None:
            self._notify(endpoint, Notice(NoticeKind.RELEASED, room).to_frames())
            return
        self._lanes.abort(str(room))
        log.info("Lynx: room %s aborted (%s)", room, reason)

    def stats(self) -> SenderStats:
        with self._lock:
            return SenderStats(
                rooms=len(self._rooms),
                waiting_for_space=sum(1 for s in self._rooms.values() if s.offset is None),
                buffer_bytes=self._arena.capacity,
                buffer_used=self._arena.used,
                anchor_bytes=self._sent[Stream.ANCHOR],
                residual_bytes=self._sent[Stream.RESIDUAL],
            )

    def close(self) -> None:
        self._stop.set()
        self._reaper.join(timeout=5)
        self._lanes.close()

    # ---- internals ----------------------------------------------------------------------------

    def _start(self, state: _Room) -> bool:
        plan = state.plan
        offset = self._arena.allocate(plan.encoded_nbytes)
        if offset is None:
            return False
        state.offset = offset
        self._lanes.register_destination(str(state.room), state.peer, state.offer.spans(), lanes=state.lanes)
        return True

    def _encode_pending(self, state: _Room) -> None:
        assert state.offset is not None
        plan = state.plan
        submitted: list[tuple[Lane, list[tuple[int, int, int]], bool]] = []
        while state.pending:
            slots, last = state.pending.popleft()
            state.slots.append(slots)
            state.tokens += slots.numel()
            ready = plan.ready(state.tokens, last=last)[state.segments_sent :]
            if last and state.tokens < plan.n_tokens:
                self._fail(state.room, f"prefill sent {state.tokens} tokens, decode expects {plan.n_tokens}")
                return
            if not ready and not last:
                continue
            all_slots = torch.cat(state.slots)[: plan.n_tokens].to(self._buffer.device)
            space = self._buffer[state.offset : state.offset + plan.encoded_nbytes]
            # decode's address of each stream's region
            regions = {Stream.ANCHOR: state.offer.anchor_addr, Stream.RESIDUAL: state.offer.residual_addr}
            writes: dict[Stream, list[tuple[int, int, int]]] = {stream: [] for stream in plan.streams}
            try:
                for seg in ready:
                    anchor, residual = plan.byte_ranges(seg)
                    encode_pages(
                        self._k,
                        self._v,
                        all_slots[seg.start : seg.end],
                        self.handshake.codec,
                        space[anchor],
                        space[residual],
                    )
                    for stream, span in plan.sent_ranges(seg):
                        dst = regions[stream] + span.start - plan.region_offset(stream)
                        writes[stream].append((space.data_ptr() + span.start, dst, span.stop - span.start))
            except CodecError as exc:
                self._fail(state.room, f"cannot encode the KV of room {state.room}: {exc}")
                return
            state.segments_sent += len(ready)
            for stream, stream_writes in writes.items():
                if stream_writes or last:  # a chunk of protected segments only has no Residual
                    submitted.append((_LANE_OF_STREAM[stream], stream_writes, last))
            if last:
                state.closed = True
        if not submitted:
            return
        if self._buffer.is_cuda:
            # The lanes read the buffer from another thread: the encode must be done.
            torch.cuda.current_stream(self._buffer.device).synchronize()
        now = time.monotonic()
        for lane, writes, last in submitted:
            if self._hold_s[lane] > 0:
                self._held[lane].append((now + self._hold_s[lane], state.room, lane, writes, last))
            else:
                self._submit(state.room, lane, writes, last)

    def _submit(self, room: int, lane: Lane, writes: list[tuple[int, int, int]], last: bool) -> None:
        try:
            self._lanes.submit(str(room), lane, writes, last=last)
        except (LaneError, KeyError) as exc:  # the request failed or was aborted meanwhile
            log.info("Lynx: room %s: %s", room, exc)
            return
        self._sent[_STREAM_OF_LANE[lane]] += sum(w[2] for w in writes)

    def _submit_due(self) -> None:
        now = time.monotonic()
        for held in self._held.values():
            while True:
                with self._lock:
                    if not held or held[0][0] > now:
                        break
                    _, room, lane, writes, last = held.popleft()
                self._submit(room, lane, writes, last)

    def _fail(self, room: int, reason: str) -> None:
        log.error("Lynx: room %s failed: %s", room, reason)
        self.abort(room, reason)
        self._on_failure(room, reason)

    def _on_settled(self, status: StreamStatus) -> None:  # lanes driver thread
        room = int(status.request_id)
        ok = status.state is StreamState.DONE
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return
            state.settled.add(status.lane)
            endpoint = state.endpoint
            all_settled = len(state.settled) == len(state.lanes)
            failed = status.state is StreamState.FAILED and not state.failed
            if failed:  # the lanes fail every stream of the room: report it once
                state.closed = state.failed = True
                state.pending.clear()
                self._end(room)
        if status.state is not StreamState.ABORTED:
            notice = Notice(
                NoticeKind.LANDED,
                room,
                stream=_STREAM_OF_LANE[status.lane],
                ok=ok,
                nbytes=status.bytes_done,
                text=status.error or "",
            )
            self._notify(endpoint, notice.to_frames())
        if all_settled:  # only now: RELEASED must not overtake this LANDED
            with self._lock:
                self._releasing.add(room)
        if failed:
            self._on_failure(room, f"Lynx {status.lane.name} lane: {status.error}")

    def _end(self, room: int) -> None:
        """Remember (lock held) that ``room`` was given up: a later chunk of it must not
        start a new transfer into receive space decode may have reused."""
        self._ended[room] = None
        self._ended.move_to_end(room)
        if len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    def _reap(self) -> None:
        while not self._stop.wait(0.02):
            self._submit_due()
            with self._lock:
                candidates = list(self._releasing)
            for room in candidates:
                try:
                    self._lanes.release(str(room))
                except LaneError:
                    continue  # writes still in the engine: try again later
                except KeyError:
                    pass
                with self._lock:
                    self._releasing.discard(room)
                    state = self._rooms.pop(room, None)
                if state is None:
                    continue
                if state.offset is not None:
                    self._arena.free(state.offset)
                self._notify(state.endpoint, Notice(NoticeKind.RELEASED, room).to_frames())
