"""Prefill side: encode each request's KV pages into a send buffer and send the Anchor on
the HIGH lane, the Residual on the LOW lane, to the space decode offered.

The server's scheduler calls :meth:`ProgressiveSender.add_chunk` for each chunk of a
request it would have sent as raw KV pages, and :meth:`ProgressiveSender.pump`
regularly; both run on the scheduler thread, which owns the KV pool. A chunk is encoded
as soon as the request has send-buffer space, its Anchors first and sent at once, then
its Residuals (the last chunk's on the next pump, after upstream has the first token to
send); until its last Residual is encoded (the request does not fail while it waits for
space) :meth:`ProgressiveSender.holds_pages` tells the server not to free the request's
KV pages. Once encoded, the bytes live in the send buffer and the KV pages are no longer
needed.

The sender is a front over rooms of one job each, all under one lock
(:class:`~lynx.transfer.send_rooms.SendRooms`, which also owns each request's state):

* :mod:`lynx.transfer.offers` -- decode's offers, held until the request is sized, then
  answered ACCEPT or REJECT (bootstrap and scheduler threads; the reaper expires them);
* :mod:`lynx.transfer.layer_streams` -- a chunk's Anchor layer by layer during prefill's
  forward (scheduler thread; a gate thread on a CUDA send buffer);
* :mod:`lynx.transfer.chunk_encoder` -- chunks encoded into the request's send space, the
  Anchor first, then the Residual layer by layer (scheduler thread);
* this module -- send space and lanes, writes held on purpose (``hold_s``), what the lanes
  report (their driver thread: ``LAYERS``, ``LANDED``), aborts, and the reaper thread,
  which frees a settled request's send space and tells decode ``RELEASED`` once the
  engine holds none of its writes (only then may decode reuse its receive space).

Notices to decode (``ACCEPT``/``REJECT``/``LAYERS``/``LANDED``/``RELEASED``, see
:mod:`lynx.transfer.protocol`) go through the ``notify`` callable the server provides,
signed with the key where one is set (``--lynx-auth-key-file``); every notice echoes the
offer's nonce.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lynx.lanes import Lane, LaneConfig, LaneError, LaneScheduler, StreamState, StreamStatus, TransferBackend
from lynx.threads import Survivor
from lynx.transfer.arena import arena_over
from lynx.transfer.auth import AuthKey
from lynx.transfer.chunk_encoder import ChunkEncoder
from lynx.transfer.layer_streams import LayerStreamer, page_slots
from lynx.transfer.offers import OfferDesk
from lynx.transfer.protocol import Handshake, Notice, NoticeKind, Offer, RequestLayout, Stream
from lynx.transfer.send_rooms import (
    LANE_OF_STREAM,
    STREAM_OF_LANE,
    Endpoint,
    Notices,
    SendKV,
    SendRoom,
    SendRooms,
    Writes,
)

log = logging.getLogger(__name__)

__all__ = ["ProgressiveSender", "SenderStats", "page_slots"]


@dataclass
class SenderStats:
    rooms: int
    waiting_for_space: int
    buffer_bytes: int
    buffer_used: int
    anchor_bytes: int
    residual_bytes: int
    offers_waiting: int  # for a request that does not exist yet, or whose length is not known
    lanes_driver_alive: bool  # False: the lanes' driver thread ended, no transfer can move
    lanes_driver_errors: int  # driver passes that raised (each failed the open transfers)
    lanes_driver_cpu_s: float  # CPU time of the lanes' driver thread, engine polls included
    lanes_polls: int  # the driver's polls of the engine
    layers_streamed: int  # layer Anchors sent during prefill's forward, ahead of their chunk
    layer_encode_s: float  # spent encoding them, on the forward's path
    # reason ("expired", "overflow", "quota", "duplicate"; with a key "unsigned",
    # "bad_signature", "malformed") -> offers dropped unanswered since start
    dropped_offers: dict[str, int] = field(default_factory=dict)


class ProgressiveSender:
    """See the module docstring. ``on_failure(room, reason)`` is called (on whichever
    thread found it) when a request's Lynx transfer fails, so the server can fail it.
    ``offer_wait_s``: how long an offer for a room with no request waits for it; by
    default as long as upstream's prefill waits for decode's metadata
    (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, 300 s). ``auth``: the key notices are
    signed with and offers must carry (None: none). ``layerwise_from``: the fewest tokens a
    request has for :meth:`begin_chunk` to stream its Anchor layer by layer (0: never);
    ``layer_send_bytes``: the fewest bytes of encoded layers that leave together (None:
    :data:`~lynx.transfer.layer_streams.LAYER_SEND_BYTES` while the request's HIGH lane
    is idle, else each layer; 0: each layer alone)."""

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
        offer_wait_s: float = 300.0,
        auth: AuthKey | None = None,
        layerwise_from: int = 0,
        layer_send_bytes: int | None = None,
    ) -> None:
        self.handshake = handshake.signed_with(auth)
        self._kv = SendKV(list(k_buffers), list(v_buffers), page_size, buffer, self.handshake)
        self._arena = arena_over(buffer, "send")
        self._on_failure = on_failure
        self._notices = Notices(notify, auth)
        self._rooms = SendRooms()
        self._lock = self._rooms.lock
        self._offers = OfferDesk(
            self._rooms, handshake=self.handshake, auth=auth, notices=self._notices, offer_wait_s=offer_wait_s
        )
        self._layers = LayerStreamer(
            self._rooms,
            self._kv,
            room_of=self._room_of,
            start=self._start,
            dispatch=self._dispatch,
            fail=self._fail,
            high_in_flight=self._high_in_flight,
            layerwise_from=layerwise_from,
            layer_send_bytes=layer_send_bytes,
        )
        self._encoder = ChunkEncoder(
            self._rooms,
            self._kv,
            dispatch=self._dispatch,
            fail=self._fail,
            pass_gated_of=self._layers.pass_gated_of,
        )
        self._releasing: set[int] = set()
        self._sent = {Stream.ANCHOR: 0, Stream.RESIDUAL: 0}
        self._hold_s = {Lane.HIGH: hold_s[0], Lane.LOW: hold_s[1]}
        # writes held back on purpose (hold_s): (due, room, lane, writes, last), in due order
        self._held: dict[Lane, deque[tuple[float, int, Lane, Writes, bool]]] = {
            lane: deque() for lane in Lane
        }
        self._lanes = LaneScheduler(
            backend, lane_config, on_settled=self._on_settled, on_progress=self._on_progress
        )
        self._lanes.register_source(buffer.data_ptr(), buffer.numel())
        self._stop = threading.Event()
        self._reaper_survivor = Survivor(log, "sender reaper")
        self._reaper = threading.Thread(target=self._reap, name="lynx-sender-reaper", daemon=True)
        self._reaper.start()

    # ---- pairing (OfferDesk) -------------------------------------------------------------------

    def take_offer(
        self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str
    ) -> Offer | str | None:
        """:meth:`OfferDesk.take_offer` (bootstrap thread)."""
        return self._offers.take_offer(room, offer_bytes, endpoint, session)

    def take_metadata(self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str) -> bool:
        """:meth:`OfferDesk.take_metadata` (bootstrap thread)."""
        return self._offers.take_metadata(room, offer_bytes, endpoint, session)

    def open_room(self, room: int) -> None:
        """:meth:`OfferDesk.open_room` (scheduler thread)."""
        self._offers.open_room(room)

    def size_room(self, room: int, n_tokens: int) -> Offer | str | None:
        """:meth:`OfferDesk.size_room` (scheduler thread)."""
        return self._offers.size_room(room, n_tokens)

    def sends_no_kv(self, room: int) -> bool:
        """:meth:`OfferDesk.sends_no_kv`."""
        return self._offers.sends_no_kv(room)

    def refusal(self, room: int) -> str | None:
        """:meth:`OfferDesk.refusal`."""
        return self._offers.refusal(room)

    def close_room(self, room: int) -> None:
        """:meth:`OfferDesk.close_room`: the request is done on this side."""
        self._offers.close_room(room)

    # ---- layer by layer, during prefill's forward (LayerStreamer) -----------------------------

    def begin_chunk(self, room: int, pages: np.ndarray) -> bool:
        """:meth:`LayerStreamer.begin_chunk` (scheduler thread, before the forward)."""
        return self._layers.begin_chunk(room, pages)

    def layer_done(self, layer: int) -> None:
        """:meth:`LayerStreamer.layer_done` (scheduler thread, during the forward)."""
        self._layers.layer_done(layer)

    # ---- scheduler thread -------------------------------------------------------------------

    def add_chunk(self, room: int, pages: np.ndarray, last: bool) -> None:
        """Queue the request's next chunk (prefill page ids, in order) and pump. The
        Residuals of a request's last chunk wait for the next :meth:`pump` (the server's
        next poll of the request): the first token, which upstream sends once this returns,
        and the Anchor stream's end, both on the first token's path, must not wait for
        their encode. The room's offer must have been accepted (:meth:`refusal` is None)."""
        with self._lock:
            state = self._room_of(room)
            if state is None or state.closed:
                return
            state.pending.append((page_slots(pages, self._kv.page_size), last))
        self.pump(residuals=not last)

    def _room_of(self, room: int) -> SendRoom | None:
        """(Lock held) The request's send state, made at its first chunk from its accepted
        offer (ValueError if it has none); None if its reservation ended (its space on
        decode may already serve another request) or it can never fit the send buffer
        (the room fails)."""
        state = self._rooms.rooms.get(room)
        if state is not None:
            return state
        peer, endpoint, offer = self._offers.accepted(room)
        if self._rooms.ended(room, offer.nonce):
            return None
        # The offer's token count is this request's and its sizes match (OfferDesk._answer).
        plan = RequestLayout.of(self.handshake, offer.n_tokens)
        need = plan.encoded_nbytes
        if self._arena.rounded(need) > self._arena.capacity:  # it would hold up every later room
            self._fail(
                room,
                f"{offer.n_tokens} tokens need {need} bytes of send buffer, it has "
                f"{self._arena.capacity}: raise --lynx-buffer-bytes",
            )
            return None
        lanes = tuple(LANE_OF_STREAM[stream] for stream in plan.streams)
        state = SendRoom(room, peer, endpoint, offer, plan, lanes=lanes)
        self._rooms.rooms[room] = state
        return state

    def _high_in_flight(self, room: int) -> bool:
        """Whether some of the request's HIGH writes have not landed (or are held). Writes
        waiting for their encode on a device are not: they say nothing of the link."""
        if any(held[1] == room for held in self._held[Lane.HIGH]):
            return True
        try:
            status = self._lanes.status(str(room), Lane.HIGH)
        except (LaneError, KeyError):  # aborted meanwhile
            return False
        return status.bytes_done < status.bytes_submitted

    def pump(self, *, residuals: bool = True) -> None:
        """Encode and send the Anchors of every queued chunk whose request has (or now gets)
        space, then (``residuals``) every Residual queued behind its Anchors."""
        with self._lock:
            for state in list(self._rooms.rooms.values()):
                if state.pending and not state.closed:
                    try:
                        if state.offset is None and not self._start(state):
                            break  # first come, first served: later requests wait too
                        self._encoder.encode_pending(state)
                    except Exception as exc:  # this room fails; the scheduler thread serves on
                        log.exception("Lynx: room %s: sending its KV failed", state.room)
                        self._fail(state.room, f"cannot send the KV of room {state.room}: {exc}")
        if residuals:
            self._encoder.encode_residuals()

    def holds_pages(self, room: int) -> bool:
        """True while some of the request's chunks are not encoded yet, Anchor or Residual
        (:meth:`pump` encodes them)."""
        with self._lock:
            state = self._rooms.rooms.get(room)
            return state is not None and bool(state.pending or state.residuals)

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Stop the request's transfer (any thread); its space is reused once the engine
        holds none of its writes. If nothing of it was ever written (its offer held or
        accepted, its chunks waiting for send space), decode hears RELEASED at once."""
        with self._lock:
            state = self._rooms.rooms.get(room)
            if state is None or state.offset is None:
                unwritten = self._give_up_unwritten(room, reason)
            elif state.closed and len(state.settled) == len(state.lanes):
                return
            else:
                unwritten = None
                self._rooms.end(room, state.offer.nonce)
                state.closed = state.failed = True
                state.pending.clear()
                state.residuals.clear()
        if unwritten is not None:
            endpoint, nonce = unwritten
            self._notices.send(endpoint, Notice(NoticeKind.RELEASED, room, nonce))
            return
        if state is not None:
            self._lanes.abort(str(room))
            log.info("Lynx: room %s aborted (%s)", room, reason)

    def take_abort(self, room: int, peer: Endpoint | None) -> bool:
        """Decode's ABORT for ``room`` arrived (bootstrap thread), naming ``peer`` as its
        control endpoint (None: it names none); whether it is honoured
        (:meth:`OfferDesk.honours_abort`; then the room's transfer stops, and the caller
        lets upstream fail the request)."""
        if not self._offers.honours_abort(room, peer):
            return False
        self.abort(room, "decode aborted the request")
        return True

    def _give_up_unwritten(self, room: int, reason: str) -> tuple[Endpoint, int] | None:
        """(Lock held) ``room`` is aborted before any of its bytes went to the lanes: forget
        what it holds, and return where to send RELEASED with which nonce (None: no
        reservation of it is open here)."""
        state = self._rooms.rooms.pop(room, None)
        if state is None:
            return self._offers.give_up_unanswered(room, reason)
        state.closed = state.failed = True  # it was waiting for send space
        self._rooms.end(room, state.offer.nonce)
        return state.endpoint, state.offer.nonce

    def stats(self) -> SenderStats:
        lanes = self._lanes.stats()
        with self._lock:
            return SenderStats(
                lanes_driver_alive=lanes.driver_alive,
                lanes_driver_errors=lanes.driver_errors,
                lanes_driver_cpu_s=lanes.driver_cpu_s,
                lanes_polls=lanes.polls,
                layers_streamed=self._layers.layers_streamed,
                layer_encode_s=self._layers.layer_encode_s,
                rooms=len(self._rooms.rooms),
                waiting_for_space=sum(1 for s in self._rooms.rooms.values() if s.offset is None),
                buffer_bytes=self._arena.capacity,
                buffer_used=self._arena.used,
                anchor_bytes=self._sent[Stream.ANCHOR],
                residual_bytes=self._sent[Stream.RESIDUAL],
                offers_waiting=self._offers.waiting(),
                dropped_offers=dict(self._offers.dropped),
            )

    def close(self) -> None:
        with self._lock:
            self._stop.set()
        self._reaper.join(timeout=5)
        self._layers.close()
        self._lanes.close()

    # ---- internals ----------------------------------------------------------------------------

    def _start(self, state: SendRoom) -> bool:
        plan = state.plan
        offset = self._arena.allocate(plan.encoded_nbytes)
        if offset is None:
            return False
        try:  # refused once the lanes' driver stopped: the room fails with nothing written
            self._lanes.register_destination(
                str(state.room), state.peer, state.offer.spans(), lanes=state.lanes
            )
        except Exception:
            self._arena.free(offset)
            raise
        state.offset = offset
        return True

    def _dispatch(
        self,
        room: int,
        lane: Lane,
        writes: Writes,
        last: bool,
        now: float,
        share: float = 1.0,
    ) -> None:
        """(Lock held) Submit ``writes`` to the lanes, or hold them ``share`` of ``hold_s``
        first (a Residual's layer l of L: l / L, as a slow link lands them)."""
        if self._hold_s[lane] > 0:
            self._held[lane].append((now + share * self._hold_s[lane], room, lane, writes, last))
        else:
            self._submit(room, lane, writes, last)

    def _submit(self, room: int, lane: Lane, writes: Writes, last: bool) -> None:
        try:
            self._lanes.submit(str(room), lane, writes, last=last)
        except (LaneError, KeyError) as exc:  # the request failed or was aborted meanwhile
            log.info("Lynx: room %s: %s", room, exc)
            return
        self._sent[STREAM_OF_LANE[lane]] += sum(w[2] for w in writes)

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

    def _on_progress(self, status: StreamStatus) -> None:  # lanes driver thread
        """Parts of a LOW stream landed: tell decode the layers whose Residual now has."""
        if status.lane is not Lane.LOW:
            return
        room = int(status.request_id)
        with self._lock:
            state = self._rooms.rooms.get(room)
            if state is None or state.failed:
                return
            first = layers = state.layers_noticed
            while state.layer_marks and state.layer_marks[0][0] <= status.parts_landed:
                layers = state.layer_marks.popleft()[1]
            if layers == first:
                return
            state.layers_noticed = layers
            checksums = tuple(c for layer in state.layer_checksums[first:layers] for c in layer)
            notice = Notice(
                NoticeKind.LAYERS,
                room,
                state.offer.nonce,
                layers=layers,
                first_layer=first,
                checksums=checksums,
            )
            endpoint = state.endpoint
        self._notices.send(endpoint, notice)

    def _on_settled(self, status: StreamStatus) -> None:  # lanes driver thread
        room = int(status.request_id)
        ok = status.state is StreamState.DONE
        with self._lock:
            state = self._rooms.rooms.get(room)
            if state is None:
                return
            state.settled.add(status.lane)
            endpoint = state.endpoint
            all_settled = len(state.settled) == len(state.lanes)
            failed = status.state is StreamState.FAILED and not state.failed
            if failed:  # the lanes fail every stream of the room: report it once
                state.closed = state.failed = True
                state.pending.clear()
                state.residuals.clear()
                self._rooms.end(room, state.offer.nonce)
            stream = STREAM_OF_LANE[status.lane]
            checksums = tuple(state.checksums[stream]) if ok else ()
        if status.state is not StreamState.ABORTED:
            notice = Notice(
                NoticeKind.LANDED,
                room,
                state.offer.nonce,
                stream=stream,
                ok=ok,
                nbytes=status.bytes_done,
                checksums=checksums,
                text=status.error or "",
            )
            self._notices.send(endpoint, notice)
        if all_settled:  # only now: RELEASED must not overtake this LANDED
            with self._lock:
                self._releasing.add(room)
        if failed:
            self._on_failure(room, f"Lynx {status.lane.name} lane: {status.error}")

    def _reap(self) -> None:
        """The reaper thread: held writes, expired offers and releases, each step guarded
        (one room's exception is logged once per kind and the thread goes on with the
        others: it is the only one that frees send space and tells decode RELEASED)."""
        while not self._stop.wait(0.02):
            try:
                self._submit_due()
            except Exception as exc:  # the items taken are lost; their rooms' deadlines fail them
                self._reaper_survivor.survived("submitting held writes", exc)
            for room, held, reason in self._offers.expired():
                try:
                    self._offers.drop_offer(room, held, reason)
                except Exception as exc:
                    self._reaper_survivor.survived(f"dropping the expired offer for room {room}", exc)
            with self._lock:
                candidates = list(self._releasing)
            for room in candidates:
                try:
                    self._release(room)
                except Exception as exc:  # tried again next pass: its space is not given up
                    self._reaper_survivor.survived(f"releasing room {room}", exc)

    def _release(self, room: int) -> None:
        """(Reaper thread) free a settled room's send space and tell decode RELEASED, once
        the engine holds none of its writes."""
        with self._lock:
            state = self._rooms.rooms.get(room)
            if state is not None and state.encoding:
                return  # aborted while its Residual encodes into its space
        try:
            self._lanes.release(str(room))
        except LaneError:
            return  # writes still in the engine: try again later
        except KeyError:
            pass
        with self._lock:
            self._releasing.discard(room)
            state = self._rooms.rooms.pop(room, None)
            if state is not None:
                self._rooms.end(room, state.offer.nonce)
        if state is None:
            return
        if state.offset is not None:
            self._arena.free(state.offset)
        self._notices.send(state.endpoint, Notice(NoticeKind.RELEASED, room, state.offer.nonce))
