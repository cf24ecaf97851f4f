"""Prefill side: the sender's per-request state, and the one lock that guards it.

:class:`SendRooms` owns the lock every part of :class:`~lynx.transfer.sender.ProgressiveSender`
takes (an ``RLock``: a part may call another while it holds it) and the state of each
request whose transfer started (:class:`SendRoom`, made at its first chunk from its
accepted offer). Six threads take the lock: the scheduler (chunks, pumps, the layer-wise
forward hook), the bootstrap thread (offers, ABORTs), the lanes' driver (progress and
settles), the reaper (held writes, expired offers, releases) and, on a CUDA send buffer,
the gate that passes streamed layers once encoded. A remark "(lock held)" on a method
means its caller holds ``SendRooms.lock``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lynx.lanes import Lane
from lynx.transfer.auth import AuthKey
from lynx.transfer.protocol import Handshake, Notice, Offer, RequestLayout, Segment, Stream

Endpoint = tuple[str, int]
Writes = list[tuple[int, int, int]]  # (source address, destination address, bytes)
Fail = Callable[[int, str], None]  # fail a room's transfer (and its request), saying why

STREAM_OF_LANE = {Lane.HIGH: Stream.ANCHOR, Lane.LOW: Stream.RESIDUAL}
LANE_OF_STREAM = {stream: lane for lane, stream in STREAM_OF_LANE.items()}
# Reservations given up or released, remembered so that their late chunks are dropped and
# a replayed offer of one is refused.
_ENDED_KEPT = 1 << 16


class Dispatch(Protocol):
    """(Lock held) Hand a room's ``writes`` to its ``lane`` (``last``: the stream ends with
    them), or hold them ``share`` of the lane's hold first (a Residual's layer l of L: l / L)."""

    def __call__(
        self, room: int, lane: Lane, writes: Writes, last: bool, now: float, share: float = 1.0
    ) -> None: ...


@dataclass
class LayerStream:
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
class ResidualWork:
    """The unprotected segments of an encoded chunk whose Anchors left and whose Residuals
    are still to be encoded (``slots``: the request's, from its first token), and whether
    it is the request's last chunk (its LOW stream ends with it)."""

    segments: list[Segment]
    slots: torch.Tensor
    last: bool


@dataclass
class SendRoom:
    """One request's transfer, from its first chunk until its space is released."""

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
    streams: deque[LayerStream] = field(default_factory=deque)
    # chunks whose Anchors left and whose Residuals are still to be encoded, oldest first
    residuals: deque[ResidualWork] = field(default_factory=deque)
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

    def space(self, buffer: torch.Tensor) -> torch.Tensor:
        """The request's space in the send buffer (it has one)."""
        assert self.offset is not None
        return buffer[self.offset : self.offset + self.plan.encoded_nbytes]

    def base_on(self, stream: Stream) -> int:
        """Where on decode a write of ``stream`` from offset 0 of the request's space would
        land: a write from offset o goes to ``base_on(stream) + o``."""
        addr = self.offer.anchor_addr if stream is Stream.ANCHOR else self.offer.residual_addr
        return addr - self.plan.region_offset(stream)


@dataclass(frozen=True)
class SendKV:
    """What the sender encodes from and into: the KV pool's per-layer K and V buffers
    (token-slot major), its page size, the send buffer, and the handshake whose codec and
    layout the bytes follow."""

    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor]
    page_size: int
    buffer: torch.Tensor
    handshake: Handshake

    @property
    def num_layers(self) -> int:
        return len(self.k)


class SendRooms:
    """The lock, the rooms whose transfer started, and the reservations that ended."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.rooms: dict[int, SendRoom] = {}
        self._ended: OrderedDict[tuple[int, int], None] = OrderedDict()  # (room, nonce)

    def end(self, room: int, nonce: int) -> None:
        """Remember (lock held) that the reservation (``room``, ``nonce``) was given up or
        released: a later chunk or offer of it must not start a new transfer into receive
        space decode may have reused. A later request of the room, with a new reservation,
        is not affected."""
        self._ended[(room, nonce)] = None
        self._ended.move_to_end((room, nonce))
        if len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    def ended(self, room: int, nonce: int) -> bool:
        """(Lock held) Whether the reservation (``room``, ``nonce``) was given up or released."""
        return (room, nonce) in self._ended


class Notices:
    """Sends notices to decode through the server's ``notify(endpoint, frames)``, signed
    with ``auth`` where one is set. Called without the lock: a send may block."""

    def __init__(self, notify: Callable[[Endpoint, list[bytes]], None], auth: AuthKey | None) -> None:
        self._notify = notify
        self._auth = auth

    def send(self, endpoint: Endpoint, notice: Notice) -> None:
        self._notify(endpoint, notice.to_frames(self._auth))

    def send_unsigned(self, endpoint: Endpoint, notice: Notice) -> None:
        """For a decode that has no key (it drops a signed notice it cannot check)."""
        self._notify(endpoint, notice.to_frames())
