"""Prefill side: encode each request's KV pages into a send buffer and send the Anchor on
the HIGH lane, the Residual on the LOW lane, to the space decode offered.

The server's scheduler calls :meth:`ProgressiveSender.add_chunk` for each chunk of a
request it would have sent as raw KV pages, and :meth:`pump` regularly; both run on the
scheduler thread, which owns the KV pool. A chunk is encoded as soon as the request has
send-buffer space, its Anchors first and sent at once, then its Residuals (the last
chunk's on the next :meth:`pump`, after upstream has the first token to send); until its
last Residual is encoded (the request does not fail while it waits for space)
:meth:`holds_pages` tells the server not to free the request's KV pages. Once encoded,
the bytes live in the send buffer and the KV pages are no longer needed.

A chunk's Residuals leave layer by layer: every segment's bytes of its first layer, then
of its next (:func:`lynx.codec.residual_layer_ends`), each layer one part of the LOW
stream; as the last chunk's layers land, in order, decode hears ``LAYERS`` and may refine
them while the rest travels.

Notices to decode (``ACCEPT``/``REJECT``/``LAYERS``/``LANDED``/``RELEASED``, see
:mod:`lynx.transfer.protocol`) go through the ``notify`` callable the server provides;
``LAYERS`` and ``LANDED`` are sent from the lanes' driver thread as a stream's parts land
and when it settles, ``RELEASED`` from
this object's reaper thread once the engine holds no more of the request's writes (only
then is its send-buffer space reused and decode told it may reuse its receive space).
The reaper thread also submits writes held back on purpose (``hold_s``).

Offers are answered only for this server's own requests: decode's metadata for a room
may arrive before prefill's request for it exists (upstream creates the request's KV
sender when the scheduler takes it in, and sizes it after bootstrap), so an offer waits
until the request exists and its token count is known (:meth:`open_room`,
:meth:`size_room`). Offers for rooms with no request wait a bounded time and in bounded
number, per decode session and in all; then they are dropped and counted
(:attr:`SenderStats.dropped_offers`). Every notice echoes the offer's nonce
(:mod:`lynx.transfer.protocol`).

With a key (``auth``, ``--lynx-auth-key-file``) every notice is signed, and an offer is
taken only if it carries the key's MAC over its fields and its room: any other is
dropped before it can take a room or a place among the waiting offers, counted
(``unsigned``, ``bad_signature``, ``malformed``), logged once per decode session, and the
room's request, if it comes, fails saying so.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lynx.codec import CodecError, encode_pages, enqueue_anchor_pages, residual_layer_ends
from lynx.lanes import (
    AddressError,
    AddressRanges,
    Lane,
    LaneConfig,
    LaneError,
    LaneScheduler,
    StreamState,
    StreamStatus,
    TransferBackend,
)
from lynx.threads import Survivor
from lynx.transfer.arena import arena_over
from lynx.transfer.auth import NO_KEY, AuthKey, LogOncePerPeer
from lynx.transfer.protocol import (
    Handshake,
    Notice,
    NoticeKind,
    Offer,
    OfferBinding,
    ProtocolError,
    RequestLayout,
    Segment,
    Stream,
    check_room,
    checksum_values,
    key_mismatch,
    parse_handshake,
    span_checksum,
)

log = logging.getLogger(__name__)

Endpoint = tuple[str, int]
_STREAM_OF_LANE = {Lane.HIGH: Stream.ANCHOR, Lane.LOW: Stream.RESIDUAL}
_LANE_OF_STREAM = {stream: lane for lane, stream in _STREAM_OF_LANE.items()}
_NO_OFFER = (
    "sent no Lynx offer: it runs without --lynx (start both servers with --lynx and the same --lynx-* flags)"
)
# Reservations given up or released, remembered so that their late chunks are dropped and
# a replayed offer of one is refused.
_ENDED_KEPT = 1 << 16
_EARLY_OFFERS_KEPT = 4096  # offers for rooms this server has no request for (yet)
# ... of which one decode session may hold this many, so that no one decode evicts
# another's: it takes four sessions to reach the overall bound. With a key the session is
# covered by the offer's MAC, so this is a quota per authenticated peer; without one any
# peer may claim any session name, and only the bounds in all hold.
_EARLY_OFFERS_PER_SESSION = _EARLY_OFFERS_KEPT // 4
# What the waiting offers may hold in all, in bytes (an offer, its session and host names
# and _HELD_OFFER_OVERHEAD each): a legal offer is ~130 bytes, a hostile one up to
# ~64 KiB of names; past the budget a new one is refused.
_HELD_OFFER_OVERHEAD = 256
_EARLY_OFFER_BYTES = _EARLY_OFFERS_KEPT * 1024
# What decode hears when prefill drops its offer unanswered, by reason.
_DROPPED_OFFER = {
    "duplicate": "another offer for room {room} (bootstrap_room) came first",
    "overflow": (
        f"more than {_EARLY_OFFERS_KEPT} offers waited for rooms with no request; the oldest, "
        "for room {room}, is dropped"
    ),
    "quota": (
        f"decode session {{session}} had more than {_EARLY_OFFERS_PER_SESSION} offers waiting for "
        "rooms with no request; its oldest, for room {room}, is dropped"
    ),
    "expired": "no request for room {room} came while its offer waited",
    "budget": (
        f"the offers waiting for rooms with no request hold more than {_EARLY_OFFER_BYTES} bytes; "
        "the offer for room {room} is refused"
    ),
}


def page_slots(pages: np.ndarray | torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots (int64, CPU) of whole pages, in page order."""
    pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    if page_size == 1:
        return pages_t
    return (pages_t[:, None] * page_size + torch.arange(page_size)).reshape(-1)


@dataclass
class _HeldOffer:
    """Decode's metadata for a room, not answered yet."""

    offer_bytes: bytes | None  # None: decode runs without Lynx
    endpoint: Endpoint
    session: str
    arrived: float

    @property
    def nbytes(self) -> int:
        """What holding it costs, about: its bytes, its names and a fixed overhead."""
        offer = 0 if self.offer_bytes is None else len(self.offer_bytes)
        return offer + len(self.session) + len(self.endpoint[0]) + _HELD_OFFER_OVERHEAD


class _EarlyOffers:
    """Offers for rooms with no request (yet), oldest first, at most
    ``_EARLY_OFFERS_PER_SESSION`` per decode session, ``_EARLY_OFFERS_KEPT`` and
    ``_EARLY_OFFER_BYTES`` in all."""

    def __init__(self) -> None:
        self._offers: OrderedDict[int, _HeldOffer] = OrderedDict()
        self._by_session: dict[str, OrderedDict[int, None]] = {}
        self.nbytes = 0

    def __contains__(self, room: int) -> bool:
        return room in self._offers

    def __len__(self) -> int:
        return len(self._offers)

    def add(self, room: int, held: _HeldOffer) -> tuple[int, _HeldOffer, str] | None:
        """Hold ``held`` (``room`` holds no offer); returns the offer dropped to make room
        for it, with the reason, if any: ``held`` itself past the byte budget."""
        if self.nbytes + held.nbytes > _EARLY_OFFER_BYTES:
            return room, held, "budget"
        self._offers[room] = held
        self.nbytes += held.nbytes
        rooms = self._by_session.setdefault(held.session, OrderedDict())
        rooms[room] = None
        if len(rooms) > _EARLY_OFFERS_PER_SESSION:
            oldest = next(iter(rooms))
            return oldest, self._pop(oldest), "quota"
        if len(self._offers) > _EARLY_OFFERS_KEPT:
            oldest = next(iter(self._offers))
            return oldest, self._pop(oldest), "overflow"
        return None

    def get(self, room: int) -> _HeldOffer | None:
        return self._offers.get(room)

    def pop(self, room: int) -> _HeldOffer | None:
        return self._pop(room) if room in self._offers else None

    def expire(self, now: float, wait_s: float) -> list[tuple[int, _HeldOffer, str]]:
        """Take the offers that waited ``wait_s`` for a request."""
        expired = []
        while self._offers:
            room, held = next(iter(self._offers.items()))
            if now - held.arrived < wait_s:
                break
            expired.append((room, self._pop(room), "expired"))
        return expired

    def _pop(self, room: int) -> _HeldOffer:
        held = self._offers.pop(room)
        self.nbytes -= held.nbytes
        rooms = self._by_session[held.session]
        del rooms[room]
        if not rooms:
            del self._by_session[held.session]
        return held


LAYER_SEND_BYTES = 1 << 20
"""While nothing of a request is in flight on the HIGH lane, the Anchor layers its chunk
streams wait to leave together until they are this many bytes (the first and the last
layer leave at once); while some is, each layer leaves as it is encoded. Each send through
Mooncake's TCP transport takes CPU that prefill's forward shares: one a layer (30 a SmolLM2
chunk, 8 segments each) cost 1.16x plain PD's TTFT on an unshaped link, where a send lands
before the next layer is computed. On a slow link, where the transfer is what TTFT waits
for, sends are in flight and every layer leaves at once. SmolLM2 2k at 20 Mbit/s, TTFT:
every layer 7.3 s, 1 MiB sends throughout 8.7 s, 1 ms of link time at the peer's measured
drain rate 8.1 s, this rule 8.0 s, and 7.0 s (1.07x the Anchor's link time) once the lanes
stopped polling every 100 us while the Anchor is on the link (docs/benchmarks.md)."""


@dataclass
class _LayerStream:
    """A chunk prefill computes, whose ``segments`` (unprotected, each complete once the
    chunk is) send their Anchor layer by layer: ``slots`` are the request's from its first
    token through the chunk (on the host; ``device_slots`` on the send buffer's device),
    ``layers`` how many layers' Anchors are encoded, ``sent`` how many of them left,
    ``unchecked`` how many segments add_chunk has yet to hold to its encode."""

    segments: list[Segment]
    slots: torch.Tensor
    device_slots: torch.Tensor
    layers: int = 0
    sent: int = 0
    unchecked: int = field(init=False)

    def __post_init__(self) -> None:
        self.unchecked = len(self.segments)


@dataclass
class _GatedWrite:
    """Anchor layers encoded on a CUDA stream: their HIGH writes leave once ``done`` (an
    event recorded after the encode) has happened."""

    done: torch.cuda.Event
    room: int
    writes: list[tuple[int, int, int]]


@dataclass
class _ResidualWork:
    """The unprotected segments of an encoded chunk whose Anchors left and whose Residuals
    are still to be encoded (``slots``: the request's, from its first token), and whether
    it is the request's last chunk (its LOW stream ends with it)."""

    segments: list[Segment]
    slots: torch.Tensor
    last: bool


@dataclass
class _Room:
    room: int
    peer: str  # the decode engine's session id
    endpoint: Endpoint  # where decode takes notices
    offer: Offer
    plan: RequestLayout
    # span_checksum of each encoded segment's range on each stream, in segment order
    # (empty without the handshake's checksums flag)
    checksums: dict[Stream, list[int]] = field(default_factory=lambda: {s: [] for s in Stream})
    pending: deque[tuple[torch.Tensor, bool]] = field(default_factory=deque)
    slots: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    segments_sent: int = 0
    offset: int | None = None  # of the request's space in the send buffer
    lanes: tuple[Lane, ...] = (Lane.HIGH, Lane.LOW)
    settled: set[Lane] = field(default_factory=set)
    closed: bool = False  # last chunk encoded, or the room failed
    failed: bool = False
    # begin_chunk -> the add_chunk that encodes its segments, oldest first: under upstream's
    # overlap scheduler a request's next chunk computes before its last one is added
    streams: deque[_LayerStream] = field(default_factory=deque)
    # chunks whose Anchors left and whose Residuals are still to be encoded, oldest first
    residuals: deque[_ResidualWork] = field(default_factory=deque)
    # passes encoding its Residuals outside the lock: its space must not be freed meanwhile
    encoding: int = 0
    residual_parts: int = 0  # parts (submits with bytes) of its LOW stream so far
    # (parts, layers): once the LOW stream's first ``parts`` parts landed, the Residual of
    # layers [0, layers) of every segment has (the last chunk's layers, in order)
    layer_marks: deque[tuple[int, int]] = field(default_factory=deque)
    layers_noticed: int = 0  # the layers decode heard of in LAYERS
    # per layer, span_checksum of each encoded segment's Residual bytes of it, in segment
    # order (empty without the handshake's checksums flag)
    layer_checksums: list[list[int]] = field(default_factory=list)


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
    ``LAYER_SEND_BYTES`` while the request's HIGH lane is idle, else each layer; 0: each
    layer alone)."""

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
        self._layerwise_from = layerwise_from
        self._layer_send_bytes = layer_send_bytes
        self._arena = arena_over(buffer, "send")
        self.handshake = handshake.signed_with(auth)
        self._auth = auth
        self._log_once = LogOncePerPeer(log)
        self._buffer = buffer
        self._k, self._v = list(k_buffers), list(v_buffers)
        self._page_size = page_size
        self._notify = notify
        self._on_failure = on_failure
        self._lock = threading.RLock()
        self._rooms: dict[int, _Room] = {}
        # room -> its request's token count, None until known: this server's requests
        self._requests: dict[int, int | None] = {}
        self._offers: dict[int, _HeldOffer] = {}  # for a request whose length is not known yet
        self._early_offers = _EarlyOffers()  # for no request (yet)
        self._offer_wait_s = offer_wait_s
        self._dropped_offers: dict[str, int] = {}
        # room -> why its last offer was dropped unanswered, for its request's failure
        self._dropped_why: OrderedDict[int, str] = OrderedDict()
        # room -> (decode's session, its control endpoint, the accepted offer) or the refusal
        self._answers: dict[int, tuple[str, Endpoint, Offer] | str] = {}
        self._releasing: set[int] = set()
        self._ended: OrderedDict[tuple[int, int], None] = OrderedDict()  # (room, nonce)
        self._sent = {Stream.ANCHOR: 0, Stream.RESIDUAL: 0}
        self._layers_streamed = 0
        self._layer_encode_s = 0.0
        self._hold_s = {Lane.HIGH: hold_s[0], Lane.LOW: hold_s[1]}
        # writes held back on purpose (hold_s): (due, room, lane, writes, last), in due order
        self._held: dict[Lane, deque[tuple[float, int, Lane, list[tuple[int, int, int]], bool]]] = {
            lane: deque() for lane in Lane
        }
        # On a CUDA send buffer: streamed layers' writes waiting for their encode, in order,
        # and the thread that hands each to the lanes once it is done (started with the first).
        self._gated: deque[_GatedWrite] = deque()
        self._gate_wakes = threading.Condition(self._lock)
        self._gate: threading.Thread | None = None
        self._lanes = LaneScheduler(
            backend, lane_config, on_settled=self._on_settled, on_progress=self._on_progress
        )
        self._lanes.register_source(buffer.data_ptr(), buffer.numel())
        self._stop = threading.Event()
        self._reaper_survivor = Survivor(log, "sender reaper")
        self._reaper = threading.Thread(target=self._reap, name="lynx-sender-reaper", daemon=True)
        self._reaper.start()

    # ---- pairing -----------------------------------------------------------------------------

    def take_offer(
        self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str
    ) -> Offer | str | None:
        """Decode's metadata for ``room`` arrived (bootstrap thread) from its Mooncake
        ``session``, with control ``endpoint``, and with its Lynx offer or without
        (``offer_bytes`` None: decode runs without Lynx). Answered (ACCEPT or REJECT, and
        remembered for :meth:`add_chunk`) once this server's request for the room has its
        length (:meth:`size_room`); returns the answer if that is now, else None. With a
        key, a message without a valid MAC over its offer, ``room``, ``session`` and
        ``endpoint`` (a missing offer included) takes no room and no place among the
        waiting offers. RoomError for a room no Lynx message can name."""
        held = self._admit(room, offer_bytes, endpoint, session)
        return None if held is None else self._take(room, held)

    def take_metadata(self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str) -> bool:
        """:meth:`take_offer` for the metadata message upstream's thread reads next:
        whether it may read it. With a key, not one that is dropped unauthenticated:
        upstream would take the room in its own state for it, and answer that sender."""
        held = self._admit(room, offer_bytes, endpoint, session)
        if held is not None:
            self._take(room, held)
        return held is not None

    def _admit(
        self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str
    ) -> _HeldOffer | None:
        """The message as an offer to hold; None if, with a key, it is not authentic."""
        check_room(room)
        held = _HeldOffer(offer_bytes, endpoint, session, time.monotonic())
        if self._auth is not None and not self._authentic(room, held):
            return None  # it takes no room and no place among the waiting offers
        return held

    def _take(self, room: int, held: _HeldOffer) -> Offer | str | None:
        """Hold or answer an admitted offer (see :meth:`take_offer`)."""
        dropped: list[tuple[int, _HeldOffer, str]] = []
        try:
            with self._lock:
                dropped += self._early_offers.expire(held.arrived, self._offer_wait_s)
                if room in self._answers or room in self._offers or room in self._early_offers:
                    dropped.append((room, held, "duplicate"))
                    return None
                if room not in self._requests:
                    evicted = self._early_offers.add(room, held)
                    if evicted is not None:
                        dropped.append(evicted)
                    return None
                n_tokens = self._requests[room]
                if n_tokens is None:
                    self._offers[room] = held
                    return None
        finally:
            for dropped_room, dropped_offer, reason in dropped:
                self._drop_offer(dropped_room, dropped_offer, reason)
        return self._answer(room, held, n_tokens)

    def _authentic(self, room: int, held: _HeldOffer) -> bool:
        """Whether ``held`` carries this server's key's MAC over its offer, ``room`` and
        where it sends (its session and notice endpoint, as received). If not, it is
        dropped: counted, logged once per decode session, and its room's request fails
        saying why. Only fixed-size fields are read before the MAC is checked."""
        assert self._auth is not None
        where = f"decode {held.endpoint[0]}:{held.endpoint[1]}"
        mine = self._auth.key_id
        answer_unsigned: Notice | None = None
        if held.offer_bytes is None:  # an unsigned claim on the room: it must not take it
            reason, why = "unsigned", f"{where} {_NO_OFFER}, and this prefill server takes only signed offers"
        else:
            reason, why, answer_unsigned = self._unauthentic_offer(room, held, where, mine)
            if not reason:
                return True
        with self._lock:
            self._dropped_offers[reason] = self._dropped_offers.get(reason, 0) + 1
            self._remember_dropped(room, why)
        self._log_once(
            reason, held.session, f"dropping Lynx offers of {where} (session {held.session}): {why}"
        )
        if answer_unsigned is not None:
            self._notify(held.endpoint, answer_unsigned.to_frames())
        return False

    def _unauthentic_offer(
        self, room: int, held: _HeldOffer, where: str, mine: bytes
    ) -> tuple[str, str, Notice | None]:
        """(reason counted, why, an unsigned REJECT to send or None) for an offer that
        does not carry this server's MAC over it and its binding; ("", "", None) for one
        that does."""
        assert self._auth is not None and held.offer_bytes is not None
        answer_unsigned: Notice | None = None
        try:
            offer = Offer.from_wire(held.offer_bytes)
            theirs = Handshake.key_id_of(offer.handshake)
        except ProtocolError as exc:
            reason, why = "malformed", f"cannot read the decode server's Lynx offer: {exc}"
        else:
            if offer.verify(self._auth, OfferBinding(room, held.session, held.endpoint)):
                return "", "", None
            reason = "bad_signature" if offer.mac else "unsigned"
            if theirs != mine and (theirs == NO_KEY) == (reason == "unsigned"):  # a peer's settings
                why = key_mismatch(mine, theirs, this="this prefill server", other=where)
            else:
                what = "unsigned" if reason == "unsigned" else "not signed with this server's key"
                why = (
                    f"{where}'s offer for room {room} (session {held.session}) is {what}: forged, "
                    "replayed with another session or notice endpoint, or altered on the way"
                )
            if theirs == NO_KEY and reason == "unsigned":
                # A decode without a key applies an unsigned REJECT (its space is free at
                # once); one with a key drops it. This server writes into no space an
                # unsigned offer names, so the REJECT frees nothing a write of ours reaches.
                answer_unsigned = Notice(NoticeKind.REJECT, room, offer.nonce, text=why)
        return reason, why, answer_unsigned

    def _remember_dropped(self, room: int, why: str) -> None:
        """(Lock held) why ``room``'s offer was dropped, for :meth:`refusal`."""
        self._dropped_why[room] = why
        self._dropped_why.move_to_end(room)
        if len(self._dropped_why) > _EARLY_OFFERS_KEPT:
            self._dropped_why.popitem(last=False)

    def open_room(self, room: int) -> None:
        """This server has a request for ``room`` (scheduler thread): its offer waits for
        :meth:`size_room`, however long that takes. RoomError for a room no Lynx message
        can name (a client's ``bootstrap_room``): the caller fails that request."""
        check_room(room)
        with self._lock:
            self._requests.setdefault(room, None)
            held = self._early_offers.pop(room)
            if held is not None:
                self._offers[room] = held

    def size_room(self, room: int, n_tokens: int) -> Offer | str | None:
        """The request of ``room`` sends ``n_tokens`` tokens (scheduler thread): answer its
        offer if it came. Returns the answer, or None if no offer came yet. ``n_tokens`` is 0
        where decode's radix cache holds the whole prompt: nothing is sent (:meth:`sends_no_kv`),
        and an offer for it is refused. RoomError as :meth:`open_room`."""
        check_room(room)
        with self._lock:
            self._requests[room] = n_tokens
            held = self._offers.pop(room, None) or self._early_offers.pop(room)
        return None if held is None else self._answer(room, held, n_tokens)

    def _answer(self, room: int, held: _HeldOffer, n_tokens: int) -> Offer | str:
        """Check the offer against this side, tell decode ACCEPT or REJECT, remember it."""
        where = f"decode {held.endpoint[0]}:{held.endpoint[1]}"
        notice = None
        if held.offer_bytes is None:
            answer: Offer | str = f"{where} {_NO_OFFER}"  # it would not understand a notice
        else:
            try:
                offer = Offer.from_wire(held.offer_bytes)
            except ProtocolError as exc:  # no nonce to answer with: upstream's failure tells decode
                answer = f"cannot read the decode server's Lynx offer: {exc}"
            else:
                reason = self._offer_mismatch(offer, where, n_tokens) or self._room_unavailable(
                    room, offer, where
                )
                if reason is None:
                    answer = offer
                    notice = Notice(NoticeKind.ACCEPT, room, offer.nonce, handshake=self.handshake.to_wire())
                else:
                    answer = reason
                    notice = Notice(NoticeKind.REJECT, room, offer.nonce, text=reason)
        if isinstance(answer, str) and held.offer_bytes is not None:  # no offer: the glue says why
            log.error("Lynx: refusing room %s: %s", room, answer)
        with self._lock:
            self._answers[room] = answer if isinstance(answer, str) else (held.session, held.endpoint, answer)
        if notice is not None:
            self._send(held.endpoint, notice)
        return answer

    def _offer_mismatch(self, offer: Offer, where: str, n_tokens: int) -> str | None:
        """Why ``offer`` cannot carry this server's request of ``n_tokens`` tokens, or None.
        Sizes are compared by arithmetic: nothing is built from the peer's numbers."""
        try:
            theirs = parse_handshake(offer.handshake)
        except ProtocolError as exc:
            return f"cannot read the decode server's Lynx offer: {exc}"
        mismatch = self.handshake.mismatch(theirs, this="this prefill server", other=where)
        if mismatch is not None:
            return mismatch
        if n_tokens == 0:
            return (
                f"{where} offered space for {offer.n_tokens} tokens, this prefill server's request "
                "sends none (decode's radix cache holds its whole prompt): no offer is due"
            )
        if offer.n_tokens != n_tokens:
            return (
                f"{where} offered space for {offer.n_tokens} tokens, this prefill server's "
                f"request has {n_tokens}"
            )
        sent = RequestLayout.sent_nbytes_of(self.handshake, n_tokens)
        if (offer.anchor_nbytes, offer.residual_nbytes) != (sent[Stream.ANCHOR], sent[Stream.RESIDUAL]):
            return (
                f"{where} offered {offer.anchor_nbytes}+{offer.residual_nbytes} bytes for "
                f"{n_tokens} tokens, this side sends {sent[Stream.ANCHOR]}+{sent[Stream.RESIDUAL]}"
            )
        # The lanes check every write against these spans; spans they cannot even hold
        # would fail the room only at its first chunk, after decode was told ACCEPT.
        try:
            AddressRanges.union(offer.spans())
        except AddressError as exc:
            return f"{where} offered receive space no write can reach ({exc})"
        if offer.residual_nbytes and (
            offer.anchor_addr < offer.residual_addr + offer.residual_nbytes
            and offer.residual_addr < offer.anchor_addr + offer.anchor_nbytes
        ):
            return (
                f"{where} offered Anchor space 0x{offer.anchor_addr:x}+{offer.anchor_nbytes} and "
                f"Residual space 0x{offer.residual_addr:x}+{offer.residual_nbytes} that overlap"
            )
        return None

    def _room_unavailable(self, room: int, offer: Offer, where: str) -> str | None:
        """Why this server cannot take ``offer`` for ``room`` now, or None."""
        with self._lock:
            if room in self._rooms:
                # Its state is the previous transfer's (lanes, send space, RELEASED to come):
                # a second transfer of the room would find it and could not be told apart.
                return (
                    f"room {room} (bootstrap_room) still sends the KV of this prefill server's "
                    "previous request of the room: a room cannot be reused until its transfer drains"
                )
            if (room, offer.nonce) in self._ended:  # its space may serve another request by now
                return f"{where} offered reservation {offer.nonce:#x} of room {room} again, after it ended"
        return None

    def _drop_offer(self, room: int, held: _HeldOffer, reason: str) -> None:
        """Refuse (lock not held) an offer this server will not answer otherwise: decode's
        request fails saying why, and its receive space, which no write of ours can reach,
        is free at once (decode frees a reservation's space only on word from prefill)."""
        log.warning("Lynx: dropping decode's offer for room %s (%s)", room, reason)
        text = _DROPPED_OFFER[reason].format(room=room, session=held.session)
        with self._lock:
            self._dropped_offers[reason] = self._dropped_offers.get(reason, 0) + 1
            self._remember_dropped(room, text)
            live = self._answers.get(room)
            waiting = self._offers.get(room) or self._early_offers.get(room)
        if held.offer_bytes is None:
            return  # decode runs without Lynx: it reads no notice
        try:
            offer = Offer.from_wire(held.offer_bytes)
        except ProtocolError:
            return  # no nonce to answer with
        nonces = {
            Offer.from_wire(waiting.offer_bytes).nonce if waiting and waiting.offer_bytes else None,
            live[2].nonce if isinstance(live, tuple) else None,
        }
        if offer.nonce in nonces:
            return  # the offer being answered, sent again: refusing it would fail its request
        self._send(held.endpoint, Notice(NoticeKind.REJECT, room, offer.nonce, text=text))

    def _send(self, endpoint: Endpoint, notice: Notice) -> None:
        self._notify(endpoint, notice.to_frames(self._auth))

    def sends_no_kv(self, room: int) -> bool:
        """Whether the request of ``room`` was sized at 0 tokens: decode's radix cache
        (``decode_prefix_len``) holds its whole prompt, upstream sends only its aux data."""
        with self._lock:
            return self._requests.get(room) == 0

    def refusal(self, room: int) -> str | None:
        """Why ``room`` cannot be sent with Lynx (no offer came, it was dropped, or it was
        refused); None once its offer was accepted."""
        with self._lock:
            answer = self._answers.get(room)
            dropped = self._dropped_why.get(room)
        if answer is None:
            if dropped is not None:
                return f"decode's Lynx offer for room {room} was dropped: {dropped}"
            return f"the decode server {_NO_OFFER}"
        return answer if isinstance(answer, str) else None

    def close_room(self, room: int) -> None:
        """The request is done on this side: forget it and its offer."""
        with self._lock:
            self._requests.pop(room, None)
            self._offers.pop(room, None)
            self._early_offers.pop(room)
            self._answers.pop(room, None)
            self._dropped_why.pop(room, None)

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
            state.pending.append((page_slots(pages, self._page_size), last))
        self.pump(residuals=not last)

    def _room_of(self, room: int) -> _Room | None:
        """(Lock held) The request's send state, made at its first chunk from its accepted
        offer (ValueError if it has none); None if its reservation ended (its space on
        decode may already serve another request) or it can never fit the send buffer
        (the room fails)."""
        state = self._rooms.get(room)
        if state is not None:
            return state
        answer = self._answers.get(room)
        if answer is None or isinstance(answer, str):
            raise ValueError(f"room {room} has no accepted Lynx offer")
        peer, endpoint, offer = answer
        if (room, offer.nonce) in self._ended:
            return None
        # The offer's token count is this request's and its sizes match (_answer).
        plan = RequestLayout.of(self.handshake, offer.n_tokens)
        need = plan.encoded_nbytes
        if self._arena.rounded(need) > self._arena.capacity:  # it would hold up every later room
            self._fail(
                room,
                f"{offer.n_tokens} tokens need {need} bytes of send buffer, it has "
                f"{self._arena.capacity}: raise --lynx-buffer-bytes",
            )
            return None
        lanes = tuple(_LANE_OF_STREAM[stream] for stream in plan.streams)
        state = _Room(room, peer, endpoint, offer, plan, lanes=lanes)
        self._rooms[room] = state
        return state

    # ---- layer by layer, during prefill's forward (scheduler thread) ---------------------------

    def begin_chunk(self, room: int, pages: np.ndarray) -> bool:
        """Prefill is about to compute the request's next chunk into ``pages`` (before its
        forward; :meth:`add_chunk` follows with the same pages once the forward ends). The
        Anchors of the unprotected segments the chunk completes then leave layer by layer,
        each as soon as :meth:`layer_done` says prefill wrote that layer's KV, ahead of the
        rest of the chunk. Returns whether they will. They do not (add_chunk sends the
        chunk whole, as without this call) for a request of fewer than ``layerwise_from``
        tokens, for a room with no accepted offer, with earlier
        chunks waiting for send space or behind another room that waits, with no such
        segment in this chunk, or with pages outside the pool (add_chunk's encode names
        them). A chunk may begin before the previous one is added (upstream's overlap
        scheduler), once that one's forward is over."""
        with self._lock:
            try:
                state = self._room_of(room)
            except ValueError:
                return False
            if state is None or state.closed or state.pending:
                return False
            if state.streams and state.streams[-1].layers < len(self._k):
                return False  # the previous chunk's forward did not report every layer
            if not 0 < self._layerwise_from <= state.plan.n_tokens:
                return False
            if state.offset is None:
                if any(other.pending and other.offset is None for other in self._rooms.values()):
                    return False  # first come, first served
                try:
                    if not self._start(state):
                        return False
                except Exception:  # the lanes refused it: add_chunk's pump fails the room
                    log.exception("Lynx: room %s: cannot start its transfer", room)
                    return False
            plan = state.plan
            # ``pages`` run from the first token not added yet: under the overlap scheduler
            # they hold the previous chunk's too
            slots = torch.cat([*state.slots, page_slots(pages, self._page_size)])[: plan.n_tokens]
            tokens = slots.numel()
            if tokens and not 0 <= int(slots.min()) <= int(slots.max()) < self._k[0].shape[0]:
                return False  # on a device the encode would not check them
            done = state.segments_sent
            if state.streams:  # what the chunks computed before this one stream already
                earlier = state.streams[-1].slots
                if not torch.equal(slots[: earlier.numel()], earlier):
                    return False
                done = len(plan.ready(earlier.numel(), last=False))
            ready = plan.ready(tokens, last=tokens >= plan.n_tokens)[done:]
            segments = [seg for seg in ready if not seg.protected]
            if not segments:
                return False
            state.streams.append(_LayerStream(segments, slots, slots.to(self._buffer.device)))
            return True

    def layer_done(self, layer: int) -> None:
        """Prefill wrote layer ``layer``'s KV of the chunks it computes (during its forward):
        encode that layer's Anchor of each streaming chunk's segments, and send the layers
        encoded and not yet sent on the HIGH lane once they are enough bytes (the
        constructor's ``layer_send_bytes``) or the last layer (one write per segment).
        Layers come in order; a chunk whose next layer is another stops streaming there
        (add_chunk sends the layers left). On a CUDA send buffer the encode is enqueued on
        the current stream, after the layer's KV writes, and its writes leave once it is
        done (an event; the forward never waits): its values are checked by add_chunk's
        encode, before decode may use what left, and ``layer_encode_s`` counts only the
        enqueueing."""
        with self._lock:
            for state in list(self._rooms.values()):  # a failing room must not end the pass
                stream = state.streams[-1] if state.streams else None
                if stream is None or state.closed or stream.layers != layer:
                    continue
                started = time.perf_counter()
                assert state.offset is not None
                plan = state.plan
                space = self._buffer[state.offset : state.offset + plan.encoded_nbytes]
                try:
                    for seg in stream.segments:
                        pool = (self._k[layer : layer + 1], self._v[layer : layer + 1])
                        slots = stream.device_slots[seg.start : seg.end]
                        out = space[plan.anchor_layers(seg, layer, layer + 1)]
                        if self._buffer.is_cuda:
                            enqueue_anchor_pages(*pool, slots, self.handshake.codec, out)
                        else:
                            encode_pages(*pool, slots, self.handshake.codec, out, None)
                except CodecError as exc:
                    self._fail(state.room, f"cannot encode the KV of room {state.room}: {exc}")
                    continue
                stream.layers += 1
                self._layers_streamed += 1
                self._layer_encode_s += time.perf_counter() - started
                spans = [plan.anchor_layers(seg, stream.sent, stream.layers) for seg in stream.segments]
                enough = self._layer_send_bytes
                if enough is None:
                    # The first layer has nothing on the link to wait behind: on a slow link
                    # its company would cost a layer's compute of link time.
                    alone = stream.sent == 0 or self._high_in_flight(state.room)
                    enough = 0 if alone else LAYER_SEND_BYTES
                if stream.layers < len(self._k) and sum(s.stop - s.start for s in spans) < enough:
                    continue
                anchor_at = state.offer.anchor_addr - plan.region_offset(Stream.ANCHOR)
                writes = [(space.data_ptr() + s.start, anchor_at + s.start, s.stop - s.start) for s in spans]
                stream.sent = stream.layers
                if self._buffer.is_cuda:
                    self._gate_until_encoded(state.room, writes)
                else:
                    self._dispatch(state.room, Lane.HIGH, writes, False, time.monotonic())

    def _gate_until_encoded(self, room: int, writes: list[tuple[int, int, int]]) -> None:
        """(Lock held) Hand ``writes`` to the lanes once the encode enqueued so far on the
        current CUDA stream is done."""
        done = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spins a core
        done.record(torch.cuda.current_stream(self._buffer.device))
        self._gated.append(_GatedWrite(done, room, writes))
        if self._gate is None:
            self._gate = threading.Thread(target=self._pass_gated, name="lynx-sender-gate", daemon=True)
            self._gate.start()
        self._gate_wakes.notify()

    def _pass_gated(self) -> None:  # gate thread
        while True:
            with self._lock:
                self._gate_wakes.wait_for(lambda: self._gated or self._stop.is_set())
                if self._stop.is_set():
                    return
                head = self._gated[0]
            head.done.synchronize()
            with self._lock:
                if self._gated and self._gated[0] is head:  # else add_chunk passed it already
                    self._gated.popleft()
                    self._dispatch(head.room, Lane.HIGH, head.writes, False, time.monotonic())

    def _pass_gated_of(self, room: int) -> None:
        """(Lock held) Wait for the encode of the request's gated writes (its forward is
        over) and hand them to the lanes, ahead of its chunk's own writes."""
        kept: deque[_GatedWrite] = deque()
        for gated in self._gated:
            if gated.room == room:
                gated.done.synchronize()
                self._dispatch(room, Lane.HIGH, gated.writes, False, time.monotonic())
            else:
                kept.append(gated)
        self._gated = kept

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
            for state in list(self._rooms.values()):
                if state.pending and not state.closed:
                    try:
                        if state.offset is None and not self._start(state):
                            break  # first come, first served: later requests wait too
                        self._encode_pending(state)
                    except Exception as exc:  # this room fails; the scheduler thread serves on
                        log.exception("Lynx: room %s: sending its KV failed", state.room)
                        self._fail(state.room, f"cannot send the KV of room {state.room}: {exc}")
        if residuals:
            self._encode_residuals()

    def holds_pages(self, room: int) -> bool:
        """True while some of the request's chunks are not encoded yet, Anchor or Residual
        (:meth:`pump` encodes them)."""
        with self._lock:
            state = self._rooms.get(room)
            return state is not None and bool(state.pending or state.residuals)

    def abort(self, room: int, reason: str = "aborted") -> None:
        """Stop the request's transfer (any thread); its space is reused once the engine
        holds none of its writes. If nothing of it was ever written (its offer held or
        accepted, its chunks waiting for send space), decode hears RELEASED at once."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None or state.offset is None:
                unwritten = self._give_up_unwritten(room, reason)
            elif state.closed and len(state.settled) == len(state.lanes):
                return
            else:
                unwritten = None
                self._end(room, state.offer.nonce)
                state.closed = state.failed = True
                state.pending.clear()
                state.residuals.clear()
        if unwritten is not None:
            endpoint, nonce = unwritten
            self._send(endpoint, Notice(NoticeKind.RELEASED, room, nonce))
            return
        if state is not None:
            self._lanes.abort(str(room))
            log.info("Lynx: room %s aborted (%s)", room, reason)

    def take_abort(self, room: int, peer: Endpoint | None) -> bool:
        """Decode's ABORT for ``room`` arrived (bootstrap thread), naming ``peer`` as its
        control endpoint (None: it names none); whether it is honoured (then the room's
        transfer stops, and the caller lets upstream fail the request). Upstream's ABORT
        is unsigned: without a key it is honoured as upstream honours it; with one, only
        from the endpoint the room's signed offer named, or for a room no offer names
        here (no Lynx transfer to stop; upstream's drain ACK still frees decode's pages)."""
        if self._auth is not None:
            owner = self._owner(room)
            if owner is not None and peer != owner:
                named = "no endpoint" if peer is None else f"{peer[0]}:{peer[1]}"
                with self._lock:
                    self._dropped_offers["foreign_abort"] = self._dropped_offers.get("foreign_abort", 0) + 1
                self._log_once(
                    "foreign_abort",
                    named,
                    f"ignoring an ABORT for room {room} naming {named}: the room's signed offer came "
                    f"from decode {owner[0]}:{owner[1]}",
                )
                return False
        self.abort(room, "decode aborted the request")
        return True

    def _owner(self, room: int) -> Endpoint | None:
        """The control endpoint of the decode whose offer for ``room`` this server holds,
        answered or waiting; None if there is none."""
        with self._lock:
            state = self._rooms.get(room)
            if state is not None:
                return state.endpoint
            answer = self._answers.get(room)
            if isinstance(answer, tuple):
                return answer[1]
            held = self._offers.get(room) or self._early_offers.get(room)
            return None if held is None else held.endpoint

    def _give_up_unwritten(self, room: int, reason: str) -> tuple[Endpoint, int] | None:
        """(Lock held) ``room`` is aborted before any of its bytes went to the lanes: forget
        what it holds, and return where to send RELEASED with which nonce (None: no
        reservation of it is open here)."""
        state = self._rooms.pop(room, None)
        if state is not None:  # waiting for send space
            state.closed = state.failed = True
            self._end(room, state.offer.nonce)
            return state.endpoint, state.offer.nonce
        answer = self._answers.get(room)
        if isinstance(answer, tuple):  # accepted, no chunk yet
            _, endpoint, offer = answer
            if (room, offer.nonce) in self._ended:  # aborted or released already
                return None
            self._end(room, offer.nonce)
            return endpoint, offer.nonce
        held = self._offers.pop(room, None) or self._early_offers.pop(room)
        if held is None or held.offer_bytes is None:
            return None
        if room in self._requests:  # its request must not read "no offer came"
            self._answers[room] = f"aborted ({reason}) before its offer was answered"
        try:
            offer = Offer.from_wire(held.offer_bytes)
        except ProtocolError:
            return None  # no nonce to answer with
        self._end(room, offer.nonce)
        return held.endpoint, offer.nonce

    def stats(self) -> SenderStats:
        lanes = self._lanes.stats()
        with self._lock:
            return SenderStats(
                lanes_driver_alive=lanes.driver_alive,
                lanes_driver_errors=lanes.driver_errors,
                lanes_driver_cpu_s=lanes.driver_cpu_s,
                lanes_polls=lanes.polls,
                layers_streamed=self._layers_streamed,
                layer_encode_s=self._layer_encode_s,
                rooms=len(self._rooms),
                waiting_for_space=sum(1 for s in self._rooms.values() if s.offset is None),
                buffer_bytes=self._arena.capacity,
                buffer_used=self._arena.used,
                anchor_bytes=self._sent[Stream.ANCHOR],
                residual_bytes=self._sent[Stream.RESIDUAL],
                offers_waiting=len(self._offers) + len(self._early_offers),
                dropped_offers=dict(self._dropped_offers),
            )

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            self._gate_wakes.notify()
        self._reaper.join(timeout=5)
        if self._gate is not None:
            self._gate.join(timeout=5)
        self._lanes.close()

    # ---- internals ----------------------------------------------------------------------------

    def _start(self, state: _Room) -> bool:
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

    def _encode_pending(self, state: _Room) -> None:
        """(Lock held) Encode the Anchors of the request's queued chunks and send them on the
        HIGH lane, its last chunk's with the stream's end; each chunk's Residuals queue
        behind (:meth:`_encode_residuals`). A protected segment travels whole on the Anchor
        stream, so it is encoded here in full."""
        assert state.offset is not None
        plan = state.plan
        sends_residual = Stream.RESIDUAL in plan.streams
        submitted: list[tuple[list[tuple[int, int, int]], bool]] = []
        checksums: list[torch.Tensor] = []
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
            self._pass_gated_of(state.room)  # what left must be encoded before it is compared
            # the chunks that streamed, by their segments' starts
            streams = {seg.start: stream for stream in state.streams for seg in stream.segments}
            anchor_at = state.offer.anchor_addr - plan.region_offset(Stream.ANCHOR)
            writes: list[tuple[int, int, int]] = []
            sent: list[slice] = []  # each ready segment's bytes on the Anchor stream
            behind: list[Segment] = []  # those whose Residual follows on its own stream
            try:
                for seg in ready:
                    anchor, residual = plan.byte_ranges(seg)
                    stream_of = streams.get(seg.start)
                    layers_out = 0 if stream_of is None else stream_of.sent
                    # A streamed segment's Anchor is coded again aside, and must match what left.
                    anchor_out = torch.empty_like(space[anchor]) if layers_out else space[anchor]
                    residual_nbytes = encode_pages(
                        self._k,
                        self._v,
                        all_slots[seg.start : seg.end],
                        self.handshake.codec,
                        anchor_out,
                        space[residual] if seg.protected else None,
                    )
                    out = plan.anchor_layers(seg, 0, layers_out)
                    if stream_of is not None:
                        stream_of.unchecked -= 1
                    if layers_out:
                        assert stream_of is not None
                        why = self._streamed_differs(seg, stream_of, all_slots, anchor_out, space, out)
                        if why is not None:
                            self._fail(
                                state.room, f"room {state.room}, tokens [{seg.start}, {seg.end}): {why}"
                            )
                            return
                        space[out.stop : anchor.stop] = anchor_out[out.stop - anchor.start :]
                    if sends_residual and not seg.protected:
                        behind.append(seg)
                    stream, span = plan.sent_ranges(seg, residual_nbytes if seg.protected else None)[0]
                    assert stream is Stream.ANCHOR
                    sent.append(span)
                    start = max(span.start, out.stop)  # what left layer by layer does not again
                    if start < span.stop:
                        writes.append((space.data_ptr() + start, anchor_at + start, span.stop - start))
            except CodecError as exc:
                self._fail(state.room, f"cannot encode the KV of room {state.room}: {exc}")
                return
            if self.handshake.checksums:  # after the chunk's encode: interleaved with it, slower
                checksums.extend(span_checksum(space[span]) for span in sent)
            state.segments_sent += len(ready)
            state.streams = deque(stream for stream in state.streams if stream.unchecked)
            if writes or last:  # a chunk of streamed layers only has nothing left to send
                submitted.append((writes, last))
            if behind or (sends_residual and last):  # the stream ends even without bytes
                state.residuals.append(_ResidualWork(behind, all_slots, last))
            if last:
                state.closed = True
        state.checksums[Stream.ANCHOR].extend(checksum_values(checksums))
        if not submitted:
            return
        if self._buffer.is_cuda:
            # The lanes read the buffer from another thread: the encode must be done.
            torch.cuda.current_stream(self._buffer.device).synchronize()
        now = time.monotonic()
        for writes, last in submitted:
            self._dispatch(state.room, Lane.HIGH, writes, last, now)

    def _encode_residuals(self) -> None:
        """Encode and send every queued Residual, oldest room and chunk first, on the LOW
        lane (scheduler thread). The encode runs outside the lock (and the C++ codec outside
        the GIL), so the lanes' driver reports the streams that settle meanwhile, the
        Anchor's among them, and upstream's workers send the first token, without waiting
        for it; ``encoding`` keeps the room's space from being freed under it."""
        while True:
            with self._lock:
                state = next((s for s in self._rooms.values() if s.residuals and not s.failed), None)
                if state is None:
                    return
                work = state.residuals.popleft()
                state.encoding += 1
            try:
                self._encode_residual(state, work)
            except Exception as exc:  # this room fails; the scheduler thread serves on
                log.exception("Lynx: room %s: sending its Residual failed", state.room)
                self._fail(state.room, f"cannot send the KV of room {state.room}: {exc}")
            finally:
                with self._lock:
                    state.encoding -= 1

    def _encode_residual(self, state: _Room, work: _ResidualWork) -> None:
        """(Lock not held) Encode the Residuals of ``work``'s segments against the Anchors
        that left for them, and send them layer by layer, one LOW part a layer (with the
        stream's end for the last chunk, whose layers are marked for ``LAYERS``)."""
        assert state.offset is not None
        plan = state.plan
        space = self._buffer[state.offset : state.offset + plan.encoded_nbytes]
        residual_at = state.offer.residual_addr - plan.region_offset(Stream.RESIDUAL)
        layers: list[list[tuple[int, int, int]]] = [[] for _ in range(plan.num_layers)]
        sent: list[slice] = []
        for seg in work.segments:
            anchor, residual = plan.byte_ranges(seg)
            anchor_again = torch.empty_like(space[anchor])
            try:
                residual_nbytes = encode_pages(
                    self._k,
                    self._v,
                    work.slots[seg.start : seg.end],
                    self.handshake.codec,
                    anchor_again,
                    space[residual],
                )
                ends = residual_layer_ends(
                    space[residual], seg.end - seg.start, self.handshake.layout, self.handshake.codec
                )
            except CodecError as exc:
                self._fail(state.room, f"cannot encode the KV of room {state.room}: {exc}")
                return
            if not torch.equal(anchor_again, space[anchor]):  # a Residual codes against its Anchor
                tokens = f"tokens [{seg.start}, {seg.end})"
                self._fail(state.room, f"room {state.room}, {tokens}: the KV changed after its Anchor left")
                return
            stream, span = plan.sent_ranges(seg, residual_nbytes)[1]
            assert stream is Stream.RESIDUAL
            sent.append(span)
            for layer, (start, stop) in enumerate(itertools.pairwise([0, *ends])):
                at = span.start + start
                layers[layer].append((space.data_ptr() + at, residual_at + at, stop - start))
        if self._buffer.is_cuda:
            torch.cuda.current_stream(self._buffer.device).synchronize()
        checksums: list[int] = []
        by_layer: list[list[int]] = [[] for _ in layers]
        if self.handshake.checksums:
            checksums = checksum_values([span_checksum(space[span]) for span in sent])
            parts = [(src - space.data_ptr(), n) for writes in layers for src, _, n in writes]
            values = iter(checksum_values([span_checksum(space[at : at + n]) for at, n in parts]))
            by_layer = [[next(values) for _ in writes] for writes in layers]
        with self._lock:
            if state.failed:
                return
            state.checksums[Stream.RESIDUAL].extend(checksums)
            if not state.layer_checksums:
                state.layer_checksums = [[] for _ in layers]
            for mine, more in zip(state.layer_checksums, by_layer, strict=True):
                mine.extend(more)
            now = time.monotonic()
            if not work.segments:  # the stream ends without bytes
                self._dispatch(state.room, Lane.LOW, [], work.last, now)
                return
            for layer, writes in enumerate(layers, start=1):
                last_layer = layer == plan.num_layers
                share = layer / plan.num_layers
                self._dispatch(state.room, Lane.LOW, writes, work.last and last_layer, now, share)
                state.residual_parts += 1
                if work.last and not last_layer:  # the last layer's landing is LANDED's
                    state.layer_marks.append((state.residual_parts, layer))

    @staticmethod
    def _streamed_differs(
        seg: Segment,
        stream: _LayerStream,
        all_slots: torch.Tensor,
        anchor_out: torch.Tensor,
        space: torch.Tensor,
        out: slice,
    ) -> str | None:
        """Why the Anchor layers of ``seg`` that left during the forward (``out``, in the
        request's space) are not the chunk's own: other KV slots than announced, or KV
        that changed after its layer was written. None when they match, byte for byte."""
        tokens = slice(seg.start, seg.end)
        if not torch.equal(stream.slots[tokens], all_slots[tokens].to(stream.slots.device)):
            return "prefill computed them into other KV slots than it announced before its forward"
        start = out.start - seg.anchor_offset
        if not torch.equal(anchor_out[start : start + out.stop - out.start], space[out]):
            return "their Anchor sent layer by layer differs from the chunk's: the KV changed after"
        return None

    def _dispatch(
        self,
        room: int,
        lane: Lane,
        writes: list[tuple[int, int, int]],
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

    def _on_progress(self, status: StreamStatus) -> None:  # lanes driver thread
        """Parts of a LOW stream landed: tell decode the layers whose Residual now has."""
        if status.lane is not Lane.LOW:
            return
        room = int(status.request_id)
        with self._lock:
            state = self._rooms.get(room)
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
        self._send(endpoint, notice)

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
                state.residuals.clear()
                self._end(room, state.offer.nonce)
            stream = _STREAM_OF_LANE[status.lane]
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
            self._send(endpoint, notice)
        if all_settled:  # only now: RELEASED must not overtake this LANDED
            with self._lock:
                self._releasing.add(room)
        if failed:
            self._on_failure(room, f"Lynx {status.lane.name} lane: {status.error}")

    def _end(self, room: int, nonce: int) -> None:
        """Remember (lock held) that the reservation (``room``, ``nonce``) was given up or
        released: a later chunk or offer of it must not start a new transfer into receive
        space decode may have reused. A later request of the room, with a new reservation,
        is not affected."""
        self._ended[(room, nonce)] = None
        self._ended.move_to_end((room, nonce))
        if len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    def _reap(self) -> None:
        """The reaper thread: held writes, expired offers and releases, each step guarded
        (one room's exception is logged once per kind and the thread goes on with the
        others: it is the only one that frees send space and tells decode RELEASED)."""
        while not self._stop.wait(0.02):
            try:
                self._submit_due()
            except Exception as exc:  # the items taken are lost; their rooms' deadlines fail them
                self._reaper_survivor.survived("submitting held writes", exc)
            with self._lock:
                expired = self._early_offers.expire(time.monotonic(), self._offer_wait_s)
            for room, held, reason in expired:
                try:
                    self._drop_offer(room, held, reason)
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
            state = self._rooms.get(room)
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
            state = self._rooms.pop(room, None)
            if state is not None:
                self._end(room, state.offer.nonce)
        if state is None:
            return
        if state.offset is not None:
            self._arena.free(state.offset)
        self._send(state.endpoint, Notice(NoticeKind.RELEASED, room, state.offer.nonce))
