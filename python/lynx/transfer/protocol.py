"""Lynx's control messages between a prefill and a decode server (protocol v2).

SGLang's Mooncake connector already carries, over ZMQ, a per-request metadata message
from decode to prefill (the room, decode's page ids, the aux slot) and status messages
from prefill to decode. Lynx adds:

* an **offer**, appended to decode's per-request metadata message as two trailing frames
  ``[TAG, offer bytes]``: decode's settings handshake, where the request's Anchor and
  Residual may be written in decode's receive buffer, and how many tokens they cover.
  Upstream's parser reads frames by position and ignores trailing ones, so a prefill
  without Lynx still serves the request (and decode notices: no ACCEPT comes back);
* **notices** from prefill to decode, each a message ``[TAG, kind, payload]`` on the same
  ZMQ endpoint as upstream's status messages: ``ACCEPT`` (prefill's handshake, it will
  send Lynx bytes), ``REJECT`` (why it will not), ``LANDED`` (one stream of the request
  has settled: every byte landed, or it failed) and ``RELEASED`` (prefill holds no more
  writes in flight to the request's receive space, which decode may then reuse).

Every integer is little-endian. The layouts, pinned by ``test/unit/test_transfer_protocol.py``:

=========  =====================================================================
handshake  ``<4sBBII`` magic ``b"LXHS"``, PROTOCOL_VERSION (2), mode code (0 full,
           1 anchor-only, 2 speculative), protect_first, protect_last (tokens);
           then the codec's ``CodecConfig.to_wire()`` (11 bytes) and
           ``KVLayout.to_wire()`` (11 bytes): 36 bytes
offer      ``<H`` handshake length, handshake, ``<QQQQQ`` anchor address, anchor bytes,
           residual address, residual bytes (0 and 0 in anchor-only mode), tokens
ACCEPT     ``<Q`` room, handshake
REJECT     ``<Q`` room, UTF-8 reason
LANDED     ``<QBBQ`` room, lane (0 Anchor, 1 Residual), ok (1/0), bytes landed; UTF-8 error
RELEASED   ``<Q`` room
=========  =====================================================================

v1 (before protected tokens) had the 6-byte head ``<4sBB`` and no protection; a v1
peer's handshake fails the version check.

The bytes of one request travel as segments, each encoded on its own
(``lynx.codec.encode_pages``) and placed back to back, Anchor and Residual each in their
own region; ``RequestLayout`` is the one definition both sides use, and what it says a
mode sends is what both sides send and expect:

* segments end at every multiple of ``SEGMENT_TOKENS`` and at the two protection bounds
  below (the last segment may be shorter);
* **protected tokens**: the first ``protect_first`` and the last ``protect_last`` tokens
  of the request travel at full precision with the Anchor: a protected segment's
  Residual bytes sit in the Anchor region right after its Anchor bytes, and the Residual
  region holds only the unprotected segments' Residuals. With per-channel keys the
  bounds are rounded outwards to multiples of ``key_block`` counted from the request's
  first token (the head range's end up, the tail range's start down), so no key block
  is split; when the two ranges meet, every token is protected and the Residual region
  is empty (no Residual stream travels, as in anchor-only mode);
* every boundary falls on a multiple of ``key_block``, so per-channel key blocks never
  straddle segments, and it depends only on the token count and the handshake, so the
  decoded KV does not depend on how prefill chunked the prompt.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import struct
from dataclasses import dataclass

from lynx.codec import CodecConfig, KVLayout, segment_nbytes
from lynx.codec.format import CONFIG_WIRE_NBYTES
from lynx.mode import Mode

PROTOCOL_VERSION = 2
TAG = b"LYNX1"
SEGMENT_TOKENS = 256
"""Tokens per encoded segment: a multiple of every allowed ``key_block`` (<= 256)."""

_MODE_CODES: dict[Mode, int] = {Mode.FULL: 0, Mode.ANCHOR_ONLY: 1, Mode.SPECULATIVE: 2}
# Magic, version and mode lead in every protocol version, so that any peer's version is
# read and named; what follows is this version's.
_HANDSHAKE_HEAD = struct.Struct("<4sBB")
_HANDSHAKE_PROTECTION = struct.Struct("<II")
_HANDSHAKE_MAGIC = b"LXHS"
_OFFER_HEAD = struct.Struct("<H")
_OFFER_BODY = struct.Struct("<QQQQQ")
_ROOM = struct.Struct("<Q")
_LANDED = struct.Struct("<QBBQ")


class ProtocolError(ValueError):
    """A Lynx control message that cannot be parsed (another version, or corrupt)."""


class NoticeKind(enum.Enum):
    ACCEPT = b"ACCEPT"
    REJECT = b"REJECT"
    LANDED = b"LANDED"
    RELEASED = b"RELEASED"


class Stream(enum.IntEnum):
    ANCHOR = 0
    RESIDUAL = 1


@dataclass(frozen=True)
class Handshake:
    """What a prefill and a decode server must agree on before any Lynx byte moves."""

    mode: Mode
    codec: CodecConfig
    layout: KVLayout
    # Prompt tokens at the start / end of each request sent at full precision with the
    # Anchor (``RequestLayout``); both sides must cut requests alike, so they are paired.
    protect_first: int = 0
    protect_last: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))  # frozen; a name is accepted
        if not (0 <= self.protect_first < 1 << 32 and 0 <= self.protect_last < 1 << 32):
            raise ValueError(
                f"protected token counts must fit a u32, got {self.protect_first} and {self.protect_last}"
            )

    def to_wire(self) -> bytes:
        head = _HANDSHAKE_HEAD.pack(_HANDSHAKE_MAGIC, PROTOCOL_VERSION, _MODE_CODES[self.mode])
        protection = _HANDSHAKE_PROTECTION.pack(self.protect_first, self.protect_last)
        return head + protection + self.codec.to_wire() + self.layout.to_wire()

    @classmethod
    def from_wire(cls, data: bytes) -> Handshake:
        size = _HANDSHAKE_HEAD.size + _HANDSHAKE_PROTECTION.size
        if len(data) < _HANDSHAKE_HEAD.size:
            raise ProtocolError(f"Lynx handshake is {len(data)} bytes, too short")
        magic, version, mode = _HANDSHAKE_HEAD.unpack_from(data)
        if magic != _HANDSHAKE_MAGIC:
            raise ProtocolError(f"not a Lynx handshake (magic {magic!r})")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"peer speaks Lynx protocol v{version}, this server v{PROTOCOL_VERSION}")
        modes = {code: name for name, code in _MODE_CODES.items()}
        if mode not in modes:
            raise ProtocolError(f"unknown Lynx mode code {mode}")
        if len(data) < size:
            raise ProtocolError(f"Lynx handshake is {len(data)} bytes, too short")
        protect_first, protect_last = _HANDSHAKE_PROTECTION.unpack_from(data, _HANDSHAKE_HEAD.size)
        codec_wire = data[size : size + CONFIG_WIRE_NBYTES]
        layout_wire = data[size + CONFIG_WIRE_NBYTES :]
        return cls(
            modes[mode],
            CodecConfig.from_wire(codec_wire),
            KVLayout.from_wire(layout_wire),
            protect_first,
            protect_last,
        )

    def describe(self) -> str:
        c, lay = self.codec, self.layout
        return (
            f"mode={self.mode} anchor_bits={c.anchor_bits} group_size={c.group_size} "
            f"residual={c.residual} key_layout={c.key_layout} key_block={c.key_block} "
            f"protect_first={self.protect_first} protect_last={self.protect_last} "
            f"kv=[{lay.num_layers} layers x {lay.num_kv_heads} heads x {lay.head_dim}, "
            f"{str(lay.dtype).removeprefix('torch.')}]"
        )

    def mismatch(self, peer: Handshake, *, this: str, other: str) -> str | None:
        """None if the two agree, else a message naming both sides' settings."""
        if peer == self:
            return None
        return (
            f"Lynx settings differ between {this} ({self.describe()}) and {other} "
            f"({peer.describe()}): start both servers with the same --lynx-* flags "
            "and the same model and KV dtype"
        )


def parse_handshake(data: bytes) -> Handshake:
    """``Handshake.from_wire``, with the codec's own errors as ProtocolError."""
    try:
        return Handshake.from_wire(data)
    except ProtocolError:
        raise
    except ValueError as exc:  # the codec's WireMismatchError / CodecInputError
        raise ProtocolError(str(exc)) from exc


@dataclass(frozen=True)
class Offer:
    """Decode's receive space for one request, appended to its metadata message."""

    handshake: bytes
    anchor_addr: int
    anchor_nbytes: int
    residual_addr: int
    residual_nbytes: int
    n_tokens: int

    def to_wire(self) -> bytes:
        body = _OFFER_BODY.pack(
            self.anchor_addr, self.anchor_nbytes, self.residual_addr, self.residual_nbytes, self.n_tokens
        )
        return _OFFER_HEAD.pack(len(self.handshake)) + self.handshake + body

    @classmethod
    def from_wire(cls, data: bytes) -> Offer:
        try:
            (n,) = _OFFER_HEAD.unpack_from(data)
            handshake = data[_OFFER_HEAD.size : _OFFER_HEAD.size + n]
            body = data[_OFFER_HEAD.size + n :]
            if len(handshake) != n or len(body) != _OFFER_BODY.size:
                raise struct.error("length")
            return cls(handshake, *_OFFER_BODY.unpack(body))
        except struct.error:
            raise ProtocolError(f"malformed Lynx offer ({len(data)} bytes)") from None

    def spans(self) -> list[tuple[int, int]]:
        """Decode's (address, length) spans granted to this request."""
        spans = [(self.anchor_addr, self.anchor_nbytes)]
        if self.residual_nbytes:
            spans.append((self.residual_addr, self.residual_nbytes))
        return spans


def append_offer(frames: list[bytes], offer: Offer) -> list[bytes]:
    return [*frames, TAG, offer.to_wire()]


def split_offer(frames: list[bytes]) -> tuple[list[bytes], bytes | None]:
    """(upstream frames, offer bytes or None) of a metadata message."""
    if len(frames) >= 2 and frames[-2] == TAG:
        return frames[:-2], frames[-1]
    return frames, None


@dataclass(frozen=True)
class Notice:
    """A prefill -> decode message about one request."""

    kind: NoticeKind
    room: int
    handshake: bytes = b""  # ACCEPT
    text: str = ""  # REJECT reason, LANDED error
    stream: Stream = Stream.ANCHOR  # LANDED
    ok: bool = True  # LANDED
    nbytes: int = 0  # LANDED

    def to_frames(self) -> list[bytes]:
        if self.kind is NoticeKind.ACCEPT:
            payload = _ROOM.pack(self.room) + self.handshake
        elif self.kind is NoticeKind.REJECT:
            payload = _ROOM.pack(self.room) + self.text.encode()
        elif self.kind is NoticeKind.LANDED:
            payload = (
                _LANDED.pack(self.room, int(self.stream), int(self.ok), self.nbytes) + self.text.encode()
            )
        else:
            payload = _ROOM.pack(self.room)
        return [TAG, self.kind.value, payload]

    @classmethod
    def from_frames(cls, frames: list[bytes]) -> Notice:
        if len(frames) != 3 or frames[0] != TAG:
            raise ProtocolError(f"not a Lynx notice ({len(frames)} frames)")
        try:
            kind = NoticeKind(frames[1])
        except ValueError:
            raise ProtocolError(f"unknown Lynx notice {frames[1]!r}") from None
        payload = frames[2]
        try:
            if kind is NoticeKind.LANDED:
                room, stream, ok, nbytes = _LANDED.unpack_from(payload)
                text = payload[_LANDED.size :].decode()
                return cls(kind, room, text=text, stream=Stream(stream), ok=bool(ok), nbytes=nbytes)
            (room,) = _ROOM.unpack_from(payload)
            rest = payload[_ROOM.size :]
        except (struct.error, ValueError, UnicodeDecodeError):
            raise ProtocolError(f"malformed Lynx {kind.name} notice") from None
        if kind is NoticeKind.ACCEPT:
            return cls(kind, room, handshake=rest)
        if kind is NoticeKind.REJECT:
            return cls(kind, room, text=rest.decode(errors="replace"))
        return cls(kind, room)


def is_notice(frames: list[bytes]) -> bool:
    return bool(frames) and frames[0] == TAG


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of a request and where their bytes sit: the Anchor at
    ``anchor_offset`` of the Anchor region; the Residual at ``residual_offset`` of the
    region of :attr:`residual_stream`: the Residual region, or, for a protected segment,
    the Anchor region (right after the segment's own Anchor)."""

    start: int
    end: int
    anchor_offset: int
    anchor_nbytes: int
    residual_offset: int
    residual_nbytes: int
    protected: bool = False

    @property
    def residual_stream(self) -> Stream:
        return Stream.ANCHOR if self.protected else Stream.RESIDUAL


class RequestLayout:
    """The segments of a request of ``n_tokens`` tokens and the streams its mode sends;
    the same on both sides.

    A request's space (prefill's send buffer, decode's receive space) is its Anchor
    region followed by its Residual region. Both regions are laid out (prefill encodes
    every Residual whatever the mode), but only :attr:`streams` travel:
    ``sent_residual_nbytes`` is 0 when no Residual stream travels (anchor-only mode, or
    every token protected), and decode reserves only :attr:`receive_nbytes`.

    Tokens ``[0, protect_until)`` and ``[protect_from, n_tokens)`` are protected (see the
    module docstring): ``protect_first`` rounded up and ``n_tokens - protect_last``
    rounded down to a multiple of ``key_block`` with per-channel keys; both are
    ``n_tokens`` when every token is protected.
    """

    def __init__(
        self,
        layout: KVLayout,
        config: CodecConfig,
        n_tokens: int,
        mode: Mode,
        *,
        protect_first: int = 0,
        protect_last: int = 0,
    ) -> None:
        if n_tokens <= 0:
            raise ValueError(f"a Lynx transfer needs at least one token, got {n_tokens}")
        self.n_tokens = n_tokens
        self.mode = mode
        # Per-channel key groups span key_block tokens from a segment's start. Bounds on
        # that grid (counted from the request's start) keep every unprotected token in the
        # key group, so at the Anchor value, it has with nothing protected, and add no
        # partial group.
        block = config.key_block if config.key_layout == "per_channel" else 1
        until = min(n_tokens, -(-protect_first // block) * block)
        since = max(0, (n_tokens - protect_last) // block * block) if protect_last else n_tokens
        self.protect_until, self.protect_from = (until, since) if until < since else (n_tokens, n_tokens)
        cuts = sorted(
            {*range(0, n_tokens, SEGMENT_TOKENS), self.protect_until, self.protect_from} - {n_tokens}
        )
        self.segments: list[Segment] = []
        anchor_at = residual_at = 0
        for start, end in itertools.pairwise([*cuts, n_tokens]):
            anchor, residual = segment_nbytes(layout, end - start, config)
            if end <= self.protect_until or start >= self.protect_from:
                self.segments.append(
                    Segment(start, end, anchor_at, anchor, anchor_at + anchor, residual, True)
                )
                anchor_at += anchor + residual
            else:
                self.segments.append(Segment(start, end, anchor_at, anchor, residual_at, residual))
                anchor_at += anchor
                residual_at += residual
        self.anchor_nbytes = anchor_at
        self.residual_nbytes = residual_at

    @classmethod
    def of(cls, handshake: Handshake, n_tokens: int) -> RequestLayout:
        return cls(
            handshake.layout,
            handshake.codec,
            n_tokens,
            handshake.mode,
            protect_first=handshake.protect_first,
            protect_last=handshake.protect_last,
        )

    @property
    def protects_all(self) -> bool:
        """Every token is protected: the Anchor stream alone brings full precision."""
        return self.protect_until == self.n_tokens

    @property
    def protected_tokens(self) -> int:
        return self.protect_until + self.n_tokens - self.protect_from

    @property
    def streams(self) -> tuple[Stream, ...]:
        # An empty Residual region travels as no stream at all, the anchor-only path:
        # nothing to wait for, no LOW-lane stream to open and settle.
        if self.mode.sends_residual and not self.protects_all:
            return (Stream.ANCHOR, Stream.RESIDUAL)
        return (Stream.ANCHOR,)

    @property
    def sent_residual_nbytes(self) -> int:
        return self.residual_nbytes if Stream.RESIDUAL in self.streams else 0

    @property
    def encoded_nbytes(self) -> int:
        """Send-buffer bytes: both regions."""
        return self.anchor_nbytes + self.residual_nbytes

    @property
    def receive_nbytes(self) -> int:
        """Receive-buffer bytes: the streams that travel."""
        return self.anchor_nbytes + self.sent_residual_nbytes

    def region_offset(self, stream: Stream) -> int:
        """Where ``stream``'s region starts in the request's space."""
        return 0 if stream is Stream.ANCHOR else self.anchor_nbytes

    def byte_ranges(self, seg: Segment) -> tuple[slice, slice]:
        """(Anchor bytes, Residual bytes) of ``seg`` in the request's space."""
        residual_at = self.region_offset(seg.residual_stream) + seg.residual_offset
        return (
            slice(seg.anchor_offset, seg.anchor_offset + seg.anchor_nbytes),
            slice(residual_at, residual_at + seg.residual_nbytes),
        )

    def sent_ranges(self, seg: Segment) -> list[tuple[Stream, slice]]:
        """The bytes of ``seg`` that travel: (stream, range in the request's space)."""
        streams = (Stream.ANCHOR, seg.residual_stream)
        return [(s, r) for s, r in zip(streams, self.byte_ranges(seg), strict=True) if s in self.streams]

    def ready(self, tokens_available: int, *, last: bool) -> list[Segment]:
        """Segments wholly inside the first ``tokens_available`` tokens (all if last)."""
        if last:
            return list(self.segments)
        return [s for s in self.segments if s.end <= tokens_available]


def protection_cost(handshake: Handshake, n_tokens: int) -> tuple[int, int]:
    """What ``handshake``'s protected tokens add to one request of ``n_tokens`` tokens:
    (bytes on the Anchor stream, bytes sent in all), against the same settings with no
    token protected. The Anchor stream gains the protected tokens' Residual; in modes
    that send the Residual anyway, the total gains only the codec padding of the extra
    segment cuts. ``RequestLayout.protected_tokens`` says how many tokens that buys."""
    protected = RequestLayout.of(handshake, n_tokens)
    plain = RequestLayout.of(dataclasses.replace(handshake, protect_first=0, protect_last=0), n_tokens)
    return (
        protected.anchor_nbytes - plain.anchor_nbytes,
        protected.receive_nbytes - plain.receive_nbytes,
    )


def bytes_per_token(layout: KVLayout, config: CodecConfig) -> tuple[float, float]:
    """(Anchor, Residual) bytes per token of a full segment."""
    anchor, residual = segment_nbytes(layout, SEGMENT_TOKENS, config)
    return anchor / SEGMENT_TOKENS, residual / SEGMENT_TOKENS
