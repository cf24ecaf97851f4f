"""Decode side: lend each request receive space for its Anchor and Residual, follow what
prefill reports about it, and decode the landed bytes into the request's KV pages.

Threads: :meth:`ProgressiveReceiver.on_notice` runs on the server's message thread; every
other method on the scheduler thread, which alone writes the KV pool.

Each reservation of receive space gets a random nonce, sent in the offer; a notice is
applied only to the live reservation of its room *and* nonce. Any other is dropped and
counted (:attr:`ReceiverStats.dropped_notices`): forged, misdirected, sent before the
offer, or for a request still waiting for space. Late notices of a reservation that
ended are expected and dropped silently. With a key (``auth``, ``--lynx-auth-key-file``),
offers are signed and a notice is applied only if it carries the key's MAC, checked right
after its fixed head is read and before anything else: any other is dropped, counted
(``unsigned``, ``bad_signature``) and logged once per prefill.

Receive space is reused only when no write to it can still arrive: right after decoding
if every stream the request's transfer sends has landed, otherwise (a failed or aborted
request) once prefill says ``RELEASED`` with the reservation's nonce, at once if prefill
refused the offer (``REJECT``: it writes nothing), or when prefill is declared dead
(:meth:`ProgressiveReceiver.peer_lost`, upstream's heartbeat), never on a timer alone: a
prefill that is slow, not dead, may still write. Quarantine is kept per reservation, so a
room reused by a later request neither frees nor loses it.

Before landed bytes go into the KV pool, every segment range they come from is checked
against the checksum prefill sent for it (:func:`lynx.transfer.protocol.span_checksum`;
with the handshake's checksums flag), a stream of variable-length Residuals must hold as
many bytes as landed, and the lossless decoder refuses a corrupt Residual.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lynx.codec import CodecInputError, check_pages, decode_pages, residual_layer_ends
from lynx.mode import Mode
from lynx.transfer.arena import arena_over
from lynx.transfer.auth import AuthKey, LogOncePerPeer
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
    append_offer,
    check_room,
    checksum_values,
    is_notice,
    notice_nbytes_max,
    span_checksum,
    unsigned_reason,
)
from lynx.transfer.receive_state import STREAM_NAMES, AuxStatus, ReceiveState, ReceiveTracker, Verdict

log = logging.getLogger(__name__)

_ENDED_KEPT = 1 << 16  # ended reservations remembered, so that their late notices are not "unknown"


@dataclass(frozen=True)
class RoomReport:
    """What one request's transfer cost, for metrics and the request's meta info."""

    anchor_bytes: int
    residual_bytes: int
    anchor_latency_s: float | None  # offer sent -> Anchor landed
    residual_latency_s: float | None
    residual_space: int = 0  # receive space reserved for the Residual stream (residual_bytes at most)
    # offer sent -> prefill's first token (upstream's aux data) landed: it may stream then
    first_token_latency_s: float | None = None


@dataclass
class ReceiverStats:
    rooms: int
    waiting_for_space: int
    quarantined: int
    buffer_bytes: int
    buffer_used: int
    anchor_bytes: int
    residual_bytes: int
    # reason ("oversized", "malformed", "unsigned", "bad_signature", "unknown_reservation")
    # -> notices dropped since start
    dropped_notices: dict[str, int] = field(default_factory=dict)


@dataclass
class _Room:
    tracker: ReceiveTracker
    peer: str  # the prefill server, for error messages
    plan: RequestLayout
    nonce: int | None = None  # drawn with the receive space
    offset: int | None = None
    offer: Offer | None = None  # what the request's metadata message carries to prefill
    decoded: bool = False  # at least the Anchor is in the KV pages
    refined_layers: int = 0  # layers [0, refined_layers) hold Anchor and Residual
    refined: bool = False  # every layer does
    released: bool = False  # prefill said no write to this space can still arrive


class ReceiveCapacityError(ValueError):
    """A request needs more receive space than the whole buffer has: it could never start."""


class DuplicateRoomError(ValueError):
    """A second request for a room that already has a live reservation. The second request
    fails; the first keeps its reservation."""


class ReceiveIntegrityError(ValueError):
    """Landed bytes that must not reach the KV pool: a segment whose checksum differs from
    prefill's, a stream whose segments take other than the bytes that landed, or a lossless
    Residual that does not decode."""


class ProgressiveReceiver:
    def __init__(
        self,
        *,
        buffer: torch.Tensor,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        handshake: Handshake,
        deadline_s: float,
        on_dropped: Callable[[str], None] | None = None,
        auth: AuthKey | None = None,
    ) -> None:
        """``on_dropped(reason)`` is called (on the message thread) for each notice dropped.
        ``auth``: the key offers are signed with and notices must carry (None: none)."""
        self._arena = arena_over(buffer, "receive")
        self.handshake = handshake.signed_with(auth)
        self._auth = auth
        self._log_once = LogOncePerPeer(log)
        self._buffer = buffer
        self._k, self._v = list(k_buffers), list(v_buffers)
        self._deadline_s = deadline_s
        self._on_dropped = on_dropped
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        # reservation (room, nonce) -> (offset, prefill), until it says RELEASED or dies
        self._quarantine: dict[tuple[int, int], tuple[int, str]] = {}
        self._ended: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._dropped: dict[str, int] = {}
        self._landed_bytes = {Stream.ANCHOR: 0, Stream.RESIDUAL: 0}
        # No request that fits the buffer sends a longer notice: one is dropped unread.
        self._notice_max = notice_nbytes_max(
            RequestLayout.most_segments(handshake, self._arena.capacity) * handshake.layout.num_layers
        )
        self._oversized_logged = False

    @property
    def mode(self) -> Mode:
        return self.handshake.mode

    def register(self, room: int, n_tokens: int, peer: str) -> None:
        """Take the request of ``room`` (``n_tokens`` tokens, from prefill ``peer``), then
        :meth:`reserve` its space. Raises DuplicateRoomError if another request holds the
        room, ReceiveCapacityError if it needs more than the whole buffer, RoomError for a
        room no Lynx message can name (a client's ``bootstrap_room``)."""
        check_room(room)
        plan = RequestLayout.of(self.handshake, n_tokens)
        if self._arena.rounded(plan.receive_nbytes) > self._arena.capacity:
            raise ReceiveCapacityError(
                f"a request of {n_tokens} tokens needs {plan.receive_nbytes} bytes of "
                f"receive space, more than the whole buffer ({self._arena.capacity} bytes): "
                "raise --lynx-buffer-bytes on the decode server"
            )
        with self._lock:
            if room in self._rooms:
                raise DuplicateRoomError(
                    f"room {room} (bootstrap_room) is already taken by another request on this "
                    "decode server: each request needs its own room"
                )
            tracker = ReceiveTracker(room, self.handshake, self._deadline_s, plan)
            self._rooms[room] = _Room(tracker, peer, plan)

    def reserve(self, room: int) -> Offer | None:
        """Receive space for the registered request of ``room``, as the offer to send with
        its metadata; None while no space is free (call again later)."""
        with self._lock:
            state = self._rooms[room]
            if state.offer is not None:
                return state.offer
            plan = state.plan
            offset = self._arena.allocate(plan.receive_nbytes)
            if offset is None:
                return None
            base = self._buffer.data_ptr() + offset
            state.offset, state.nonce = offset, secrets.randbits(64)
            offer = Offer(
                self.handshake.to_wire(),
                state.nonce,
                base,
                plan.anchor_nbytes,
                base + plan.anchor_nbytes if plan.sent_residual_nbytes else 0,
                plan.sent_residual_nbytes,
                plan.n_tokens,
            )
            state.offer = offer
            state.tracker.offered()
            return state.offer

    def append_offer(self, frames: list[bytes], binding: OfferBinding) -> list[bytes]:
        """``frames`` (the request's metadata message to prefill, which names ``binding``:
        the room, this server's session and notice endpoint) with the room's offer appended
        (:func:`lynx.transfer.protocol.append_offer`), signed over ``binding`` with a key;
        unchanged if it has none."""
        with self._lock:
            state = self._rooms.get(binding.room)
            offer = None if state is None else state.offer
        if offer is None:
            return frames
        return append_offer(frames, offer if self._auth is None else offer.signed(self._auth, binding))

    def on_message(self, frames: list[bytes]) -> bool:
        """Take ``frames`` if they are a Lynx notice (True); False for any other message."""
        if not is_notice(frames):
            return False
        self.on_notice(frames)
        return True

    def on_notice(self, frames: list[bytes]) -> None:
        """Apply a notice to its live reservation. Only its fixed head is read before its
        (room, nonce) is found live, the rest only as far as the request's plan allows;
        a notice longer than any request this buffer holds could send is dropped unread.
        With a key, the MAC is checked right after the head (over at most that many bytes)."""
        if len(frames) >= 3 and len(frames[2]) > self._notice_max:
            if not self._oversized_logged:
                self._oversized_logged = True
                log.warning(
                    "Lynx: dropping a notice of %d bytes unread, at most %d are legal (logged once; "
                    "counted as oversized)",
                    len(frames[2]),
                    self._notice_max,
                )
            self._drop("oversized")
            return
        try:
            kind, room, nonce = Notice.head_of(frames)
        except ProtocolError as exc:
            log.warning("Lynx: dropping a notice: %s", exc)
            self._drop("malformed")
            return
        if self._auth is not None and self._unsigned(frames, room):
            return
        reservation = (room, nonce)
        with self._lock:
            state = self._rooms.get(room)
            live = state is not None and state.nonce == nonce
            if kind is NoticeKind.RELEASED:
                held = self._quarantine.pop(reservation, None)
                if held is not None:
                    self._arena.free(held[0])
                if held is not None or reservation in self._ended:
                    self._ended.pop(reservation, None)
                    return  # the last word on a reservation that ended
                if live:
                    assert state is not None
                    state.released = True
                    state.tracker.fail(f"prefill {state.peer} gave the request up before it landed")
                    return
            elif live:
                assert state is not None
                tracker = state.tracker
                checksums = len(state.plan.segments) if self.handshake.checksums else 0
                try:
                    notice = Notice.from_frames(frames, checksums, state.plan.num_layers)
                except ProtocolError as exc:  # its nonce says it is prefill's: the request fails
                    tracker.fail(f"prefill {state.peer} sent a Lynx notice this server cannot read: {exc}")
                    return
                landed = notice.kind is NoticeKind.LANDED and notice.stream not in tracker.landed
                if notice.kind is NoticeKind.REJECT:
                    state.released = True  # prefill refused the offer: it writes nothing to it
                tracker.on_notice(notice, state.peer)
                if landed and notice.stream in tracker.landed:
                    self._landed_bytes[notice.stream] += notice.nbytes
                return
            elif reservation in self._ended:
                return  # late for a request that ended
        log.debug("Lynx: dropping a %s notice for room %s: no such reservation", kind.name, room)
        self._drop("unknown_reservation")

    def _unsigned(self, frames: list[bytes], room: int) -> bool:
        """Drop (True) a notice that does not carry this server's key's MAC."""
        assert self._auth is not None
        reason = unsigned_reason(frames, self._auth)
        if reason is None:
            return False
        with self._lock:
            state = self._rooms.get(room)
            peer = "an unknown sender" if state is None else f"prefill {state.peer}"
        what = "unsigned Lynx notices" if reason == "unsigned" else "Lynx notices with a bad signature"
        why = (
            "this decode server signs its Lynx messages (--lynx-auth-key-file) and the sender does not"
            if reason == "unsigned"
            else "the sender signs with another --lynx-auth-key-file"
        )
        self._log_once(reason, peer, f"dropping {what} from {peer}: {why}, or they are forged")
        self._drop(reason)
        return True

    def _drop(self, reason: str) -> None:
        with self._lock:
            self._dropped[reason] = self._dropped.get(reason, 0) + 1
        if self._on_dropped is not None:
            self._on_dropped(reason)

    def verdict(self, room: int, upstream: AuxStatus) -> tuple[Verdict, str | None]:
        """(what to do, the failure reason when FAIL)."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return Verdict.FAIL, f"no Lynx state for room {room}"
            if state.decoded:
                return Verdict.READY, None
            unanswered = state.tracker.state in (ReceiveState.WAITING_SPACE, ReceiveState.OFFERED)
            verdict = state.tracker.verdict(upstream)
            if unanswered and upstream is AuxStatus.SUCCESS:
                # Prefill's notices travel on the socket of upstream's status messages, in
                # order, and a Lynx prefill answers an offer before it sends a byte: a
                # Success with no answer before it comes from a prefill without Lynx,
                # which never learnt where this space is. No write can reach it.
                state.released = True
            return verdict, state.tracker.error

    def residual_verdict(self, room: int) -> tuple[Verdict, str | None]:
        """Speculative mode, after the Anchor was decoded: DECODE once the Residual
        landed (call :meth:`write_kv` again to refine), FAIL if it never will."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return Verdict.FAIL, f"no Lynx state for room {room}"
            return state.tracker.residual_verdict(), state.tracker.error

    def write_kv(self, room: int, slots: torch.Tensor) -> bool:
        """Write the landed bytes into the request's KV rows ``slots``: the Anchor, or
        Anchor and Residual once both landed; protected tokens (``RequestLayout``) at full
        precision from the start. Speculative mode calls it again as the Residual lands:
        each call rewrites the unprotected rows of the layers whose Residual landed since
        the last (``LAYERS`` notices), at full precision, and once the whole Residual
        landed those of every layer left. A call with nothing new to write writes
        nothing. Returns whether every row now holds its full-precision (Anchor +
        Residual) value.

        Raises ReceiveIntegrityError, before any row is written, if the bytes to decode
        are not the ones prefill checksummed (with checksums on), not as many as landed,
        or hold a corrupt size or group parameter (any segment's); and for a segment whose
        lossless Residual does not decode (a corrupt code, a non-finite word), before any
        row of that segment is written (earlier segments then hold their exact values, the
        request fails). The Anchor stream is checked at its decode and again with the
        whole Residual stream once it landed; each layer a ``LAYERS`` notice reported is
        checked (its own checksum in each segment) before its rows are refined."""
        with self._lock:
            state = self._rooms[room]
            plan, offset = state.plan, state.offset
            assert offset is not None
            complete = Stream.RESIDUAL in plan.streams and state.tracker.state is ReceiveState.COMPLETE
            landed_layers = state.tracker.residual_layers if Stream.RESIDUAL in plan.streams else 0
            if state.refined or (state.decoded and landed_layers <= state.refined_layers):
                return state.refined
            rewrite = state.decoded
            first = state.refined_layers
            checksums = dict(state.tracker.checksums)
            layer_checksums = list(state.tracker.layer_checksums)
            landed_nbytes = dict(state.tracker.landed)
        if slots.numel() != plan.n_tokens:
            raise ValueError(f"room {room}: {slots.numel()} KV slots for {plan.n_tokens} tokens")
        slots = slots.to(self._k[0].device)
        space = self._buffer[offset : offset + plan.receive_nbytes]
        if complete or not rewrite:
            # The Anchor stream is read at its decode and again with the whole Residual
            # (a write into the space since the first check must not reach the KV).
            streams = [stream for stream in plan.streams if stream is Stream.ANCHOR or complete]
            self._check_landed(room, plan, space, streams, checksums, landed_nbytes)
        elif self.handshake.checksums:
            self._check_layers(room, plan, space, range(first, landed_layers), layer_checksums)
        # Protected segments are at full precision since the Anchor landed.
        segments = [seg for seg in plan.segments if not (seg.protected and rewrite)]
        layers = range(first, plan.num_layers if complete else landed_layers) if rewrite else None
        # Every segment's sizes and parameters first (with checksums off nothing else
        # vouches for them), then the rows: a corrupt one leaves none of them written.
        for write in (check_pages, decode_pages):
            for seg in segments:
                anchor_bytes, residual_bytes = plan.byte_ranges(seg)
                try:
                    write(
                        space[anchor_bytes],
                        space[residual_bytes] if seg.protected or complete or rewrite else None,
                        self._k,
                        self._v,
                        slots[seg.start : seg.end],
                        self.handshake.codec,
                        layers,
                    )
                except CodecInputError as exc:  # nothing of this segment written
                    where = f"room {room}, tokens [{seg.start}, {seg.end})"
                    raise ReceiveIntegrityError(f"{where}: {exc}") from exc
        with self._lock:
            state.decoded = True
            if complete:
                state.refined_layers = plan.num_layers
            elif rewrite:
                state.refined_layers = landed_layers
            state.refined = complete or plan.protects_all
        return state.refined

    def refined_layers(self, room: int) -> int:
        """How many of the request's layers (the first ones) :meth:`write_kv` has written
        at full precision: all of them once it returned True."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return 0
            return state.plan.num_layers if state.refined else state.refined_layers

    def _check_layers(
        self,
        room: int,
        plan: RequestLayout,
        space: torch.Tensor,
        layers: range,
        checksums: list[tuple[int, ...]],
    ) -> None:
        """Raise ReceiveIntegrityError unless each Residual-stream segment's bytes of each
        of ``layers`` hold prefill's checksum of them (``checksums[layer][segment]``)."""
        spans: list[tuple[Segment, int, int, torch.Tensor]] = []  # (segment, its index, layer, bytes)
        for index, (seg, _) in enumerate(plan.stream_ranges(Stream.RESIDUAL)):
            residual = space[plan.byte_ranges(seg)[1]]
            try:
                ends = residual_layer_ends(
                    residual, seg.end - seg.start, self.handshake.layout, self.handshake.codec
                )
            except CodecInputError as exc:
                raise ReceiveIntegrityError(f"room {room}, tokens [{seg.start}, {seg.end}): {exc}") from exc
            starts = [0, *ends]
            spans += [(seg, index, layer, residual[starts[layer] : ends[layer]]) for layer in layers]
        mine = checksum_values([span_checksum(span) for *_, span in spans])
        for (seg, index, layer, _), got in zip(spans, mine, strict=True):
            sent = checksums[layer][index]
            if got != sent:
                raise ReceiveIntegrityError(
                    f"room {room}: the Residual bytes of layer {layer} of tokens [{seg.start}, {seg.end}) "
                    f"do not match prefill's checksum ({got:#010x}, prefill sent {sent:#010x}): they were "
                    "corrupted, or are not this request's"
                )

    def _check_landed(
        self,
        room: int,
        plan: RequestLayout,
        space: torch.Tensor,
        streams: list[Stream],
        checksums: dict[Stream, tuple[int, ...]],
        landed: dict[Stream, int],
    ) -> None:
        """Raise ReceiveIntegrityError unless the ranges of ``streams`` hold what prefill
        reported: on a stream of variable-length Residuals, as many bytes as landed, each
        Residual's own count a possible one; with the handshake's checksums flag, prefill's
        checksum of every range."""
        try:
            counts = plan.residual_nbytes_in(space, streams)
        except CodecInputError as exc:
            raise ReceiveIntegrityError(f"room {room}: {exc}") from exc
        for stream in streams:
            ranges = plan.stream_ranges(stream, counts)
            if stream in plan.variable_streams:
                travelled = sum(span.stop - span.start for _, span in ranges)
                if travelled != landed[stream]:
                    raise ReceiveIntegrityError(
                        f"room {room}: the {STREAM_NAMES[stream]}'s segments say they take {travelled} "
                        f"bytes, prefill reported {landed[stream]} landed"
                    )
            if not self.handshake.checksums:
                continue
            mine = checksum_values([span_checksum(space[span]) for _, span in ranges])
            for (seg, _), got, sent in zip(ranges, mine, checksums[stream], strict=True):
                if got != sent:
                    raise ReceiveIntegrityError(
                        f"room {room}: the {STREAM_NAMES[stream]} bytes of tokens [{seg.start}, "
                        f"{seg.end}) do not match prefill's checksum ({got:#010x}, prefill sent "
                        f"{sent:#010x}): they were corrupted, or are not this request's"
                    )

    def forget(self, room: int) -> RoomReport | None:
        """The request is done with its receive space (decoded, failed or aborted)."""
        with self._lock:
            state = self._rooms.pop(room, None)
            if state is None:
                return None
            tracker = state.tracker
            if state.offset is not None:
                assert state.nonce is not None
                reservation = (room, state.nonce)
                if not state.released:  # prefill's RELEASED is still to come
                    self._ended[reservation] = None
                    if len(self._ended) > _ENDED_KEPT:
                        self._ended.popitem(last=False)
                if tracker.state is ReceiveState.COMPLETE or state.released:
                    self._arena.free(state.offset)
                else:  # prefill may still write into it
                    self._quarantine[reservation] = (state.offset, state.peer)
        return _report_of(tracker)

    def peer_lost(self, peer: str) -> None:
        """Prefill ``peer`` was declared dead (upstream's heartbeat): its engine writes
        nothing more, so the space it may have written is free, now or when its live
        requests are forgotten."""
        with self._lock:
            for reservation, (offset, owner) in list(self._quarantine.items()):
                if owner == peer:
                    del self._quarantine[reservation]
                    self._arena.free(offset)
            for state in self._rooms.values():
                if state.peer == peer and state.offer is not None:  # a later offer may be written
                    state.released = True

    def report(self, room: int) -> RoomReport | None:
        """What the request's transfer cost so far (it keeps its receive space)."""
        with self._lock:
            state = self._rooms.get(room)
            return None if state is None else _report_of(state.tracker)

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(
                rooms=len(self._rooms),
                waiting_for_space=sum(1 for s in self._rooms.values() if s.offset is None),
                quarantined=len(self._quarantine),
                buffer_bytes=self._arena.capacity,
                buffer_used=self._arena.used,
                anchor_bytes=self._landed_bytes[Stream.ANCHOR],
                residual_bytes=self._landed_bytes[Stream.RESIDUAL],
                dropped_notices=dict(self._dropped),
            )


def _report_of(tracker: ReceiveTracker) -> RoomReport:
    offered = tracker.offered_at

    def latency(at: float | None) -> float | None:
        return None if at is None or offered is None else at - offered

    return RoomReport(
        tracker.landed.get(Stream.ANCHOR, 0),
        tracker.landed.get(Stream.RESIDUAL, 0),
        latency(tracker.landed_at.get(Stream.ANCHOR)),
        latency(tracker.landed_at.get(Stream.RESIDUAL)),
        tracker.plan.sent_residual_nbytes,
        latency(tracker.upstream_success_at),
    )
