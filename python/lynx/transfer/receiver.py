"""Decode side: lend each request receive space for its Anchor and Residual, follow what
prefill reports about it, and decode the landed bytes into the request's KV pages.

Threads: :meth:`ProgressiveReceiver.on_notice` runs on the server's message thread; every
other method on the scheduler thread, which alone writes the KV pool.

Receive space is reused only when no write to it can still arrive: right after decoding
if every stream the request's transfer sends has landed, otherwise (a failed or aborted
request) once prefill says ``RELEASED``, or after ``quarantine_s`` if it never does (a
dead prefill writes nothing more).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lynx.codec import decode_pages
from lynx.mode import Mode
from lynx.transfer.arena import arena_over
from lynx.transfer.protocol import (
    Handshake,
    Notice,
    NoticeKind,
    Offer,
    ProtocolError,
    RequestLayout,
    Stream,
    append_offer,
    is_notice,
)
from lynx.transfer.receive_state import ReceiveState, ReceiveTracker, Upstream, Verdict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoomReport:
    """What one request's transfer cost, for metrics and the request's meta info."""

    anchor_bytes: int
    residual_bytes: int
    anchor_latency_s: float | None  # offer sent -> Anchor landed
    residual_latency_s: float | None


@dataclass
class ReceiverStats:
    rooms: int
    waiting_for_space: int
    quarantined: int
    buffer_bytes: int
    buffer_used: int
    anchor_bytes: int
    residual_bytes: int


@dataclass
class _Room:
    tracker: ReceiveTracker
    n_tokens: int
    peer: str  # the prefill server, for error messages
    plan: RequestLayout | None = None
    offset: int | None = None
    offer: Offer | None = None  # what the request's metadata message carries to prefill
    decoded: bool = False  # at least the Anchor is in the KV pages
    refined: bool = False  # the Anchor and the Residual are
    released: bool = False  # prefill said no write to this space can still arrive


class ReceiveCapacityError(ValueError):
    """A request needs more receive space than the whole buffer has: it could never start."""


class ProgressiveReceiver:
    def __init__(
        self,
        *,
        buffer: torch.Tensor,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor],
        handshake: Handshake,
        deadline_s: float,
        quarantine_s: float | None = None,
    ) -> None:
        self._arena = arena_over(buffer, "receive")
        self.handshake = handshake
        self._buffer = buffer
        self._k, self._v = list(k_buffers), list(v_buffers)
        self._deadline_s = deadline_s
        self._quarantine_s = 2 * deadline_s if quarantine_s is None else quarantine_s
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._quarantine: dict[int, tuple[int, float]] = {}  # room -> (offset, expiry)
        self._landed_bytes = {Stream.ANCHOR: 0, Stream.RESIDUAL: 0}

    @property
    def mode(self) -> Mode:
        return self.handshake.mode

    def reserve(self, room: int, n_tokens: int, peer: str) -> Offer | None:
        """Receive space for the request's ``n_tokens`` tokens, as the offer to send with
        its metadata to prefill ``peer``; None while no space is free (call again later).
        Raises ReceiveCapacityError if it needs more than the whole buffer."""
        self._expire_quarantine()
        plan = RequestLayout.of(self.handshake, n_tokens)
        with self._lock:
            state = self._rooms.get(room)
            if state is not None and state.offset is not None:
                raise ValueError(f"room {room} already has receive space")
            if self._arena.rounded(plan.receive_nbytes) > self._arena.capacity:
                raise ReceiveCapacityError(
                    f"a request of {n_tokens} tokens needs {plan.receive_nbytes} bytes of "
                    f"receive space, more than the whole buffer ({self._arena.capacity} bytes): "
                    "raise --lynx-buffer-bytes on the decode server"
                )
            if state is None:
                tracker = ReceiveTracker(room, self.handshake, self._deadline_s, plan.streams)
                state = self._rooms[room] = _Room(tracker, n_tokens, peer)
            offset = self._arena.allocate(plan.receive_nbytes)
            if offset is None:
                return None
            base = self._buffer.data_ptr() + offset
            state.plan, state.offset = plan, offset
            state.offer = Offer(
                self.handshake.to_wire(),
                base,
                plan.anchor_nbytes,
                base + plan.anchor_nbytes if plan.sent_residual_nbytes else 0,
                plan.sent_residual_nbytes,
                n_tokens,
            )
            state.tracker.offered()
            return state.offer

    def append_offer(self, room: int, frames: list[bytes]) -> list[bytes]:
        """``frames`` (the request's metadata message to prefill) with its offer appended
        (:func:`lynx.transfer.protocol.append_offer`); unchanged if it has none."""
        with self._lock:
            state = self._rooms.get(room)
            offer = None if state is None else state.offer
        return frames if offer is None else append_offer(frames, offer)

    def on_message(self, frames: list[bytes]) -> bool:
        """Take ``frames`` if they are a Lynx notice (True); False for any other message."""
        if not is_notice(frames):
            return False
        self.on_notice(frames)
        return True

    def knows(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms

    def on_notice(self, frames: list[bytes]) -> None:
        try:
            notice = Notice.from_frames(frames)
        except ProtocolError as exc:
            log.warning("Lynx: dropping a notice: %s", exc)
            return
        with self._lock:
            if notice.kind is NoticeKind.RELEASED:
                held = self._quarantine.pop(notice.room, None)
                if held is not None:
                    self._arena.free(held[0])
                state = self._rooms.get(notice.room)
                if state is not None:
                    state.released = True
                    state.tracker.fail(f"prefill {state.peer} gave the request up before it landed")
                return
            state = self._rooms.get(notice.room)
            if state is None:
                return
            state.tracker.on_notice(notice, state.peer)
            if notice.kind is NoticeKind.LANDED and notice.ok:
                self._landed_bytes[notice.stream] += notice.nbytes

    def verdict(self, room: int, upstream: Upstream) -> tuple[Verdict, str | None]:
        """(what to do, the failure reason when FAIL)."""
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return Verdict.FAIL, f"no Lynx state for room {room}"
            if state.decoded:
                return Verdict.READY, None
            verdict = state.tracker.verdict(upstream)
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
        precision from the start. Speculative mode calls it again after the Residual
        landed, which rewrites the unprotected rows at full precision. Returns whether
        every row now holds its full-precision (Anchor + Residual) value."""
        with self._lock:
            state = self._rooms[room]
            plan, offset = state.plan, state.offset
            assert plan is not None and offset is not None
            landed = Stream.RESIDUAL in plan.streams and state.tracker.state is ReceiveState.COMPLETE
            if state.refined or (state.decoded and not landed):
                return state.refined
            rewrite = state.decoded
        if slots.numel() != plan.n_tokens:
            raise ValueError(f"room {room}: {slots.numel()} KV slots for {plan.n_tokens} tokens")
        slots = slots.to(self._k[0].device)
        space = self._buffer[offset : offset + plan.receive_nbytes]
        for seg in plan.segments:
            if seg.protected and rewrite:
                continue  # at full precision since the Anchor landed
            anchor_bytes, residual_bytes = plan.byte_ranges(seg)
            decode_pages(
                space[anchor_bytes],
                space[residual_bytes] if seg.protected or landed else None,
                self._k,
                self._v,
                slots[seg.start : seg.end],
                self.handshake.codec,
            )
        refined = landed or plan.protects_all
        with self._lock:
            state.decoded = True
            state.refined = refined
        return refined

    def forget(self, room: int) -> RoomReport | None:
        """The request is done with its receive space (decoded, failed or aborted)."""
        with self._lock:
            state = self._rooms.pop(room, None)
            if state is None:
                return None
            tracker = state.tracker
            if state.offset is not None:
                if tracker.state is ReceiveState.COMPLETE or state.released:
                    self._arena.free(state.offset)
                else:  # prefill may still write into it
                    self._quarantine[room] = (state.offset, time.monotonic() + self._quarantine_s)
        return _report_of(tracker)

    def report(self, room: int) -> RoomReport | None:
        """What the request's transfer cost so far (it keeps its receive space)."""
        with self._lock:
            state = self._rooms.get(room)
            return None if state is None else _report_of(state.tracker)

    def stats(self) -> ReceiverStats:
        self._expire_quarantine()
        with self._lock:
            return ReceiverStats(
                rooms=len(self._rooms),
                waiting_for_space=sum(1 for s in self._rooms.values() if s.offset is None),
                quarantined=len(self._quarantine),
                buffer_bytes=self._arena.capacity,
                buffer_used=self._arena.used,
                anchor_bytes=self._landed_bytes[Stream.ANCHOR],
                residual_bytes=self._landed_bytes[Stream.RESIDUAL],
            )

    def _expire_quarantine(self) -> None:
        now = time.monotonic()
        with self._lock:
            for room, (offset, expiry) in list(self._quarantine.items()):
                if now >= expiry:
                    del self._quarantine[room]
                    self._arena.free(offset)


def _report_of(tracker: ReceiveTracker) -> RoomReport:
    offered = tracker.offered_at

    def latency(stream: Stream) -> float | None:
        at = tracker.landed_at.get(stream)
        return None if at is None or offered is None else at - offered

    return RoomReport(
        tracker.landed.get(Stream.ANCHOR, 0),
        tracker.landed.get(Stream.RESIDUAL, 0),
        latency(Stream.ANCHOR),
        latency(Stream.RESIDUAL),
    )
