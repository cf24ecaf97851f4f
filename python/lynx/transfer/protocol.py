"""Lynx's control messages between a prefill and a decode server (protocol v1).

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
handshake  ``<4sBB`` magic ``b"LXHS"``, PROTOCOL_VERSION, mode code; then the codec's
           ``CodecConfig.to_wire()`` (11 bytes) and ``KVLayout.to_wire()`` (11 bytes)
offer      ``<H`` handshake length, handshake, ``<QQQQQ`` anchor address, anchor bytes,
           residual address, residual bytes (0 and 0 in anchor-only mode), tokens
ACCEPT     ``<Q`` room, handshake
REJECT     ``<Q`` room, UTF-8 reason
LANDED     ``<QBBQ`` room, lane (0 Anchor, 1 Residual), ok (1/0), bytes landed; UTF-8 error
RELEASED   ``<Q`` room
=========  =====================================================================

The bytes of one request travel as segments of ``SEGMENT_TOKENS`` tokens (the last one
shorter), each encoded on its own (``lynx.codec.encode_pages``) and placed back to back,
Anchor and Residual each in their own region; ``RequestLayout`` is the one definition
both sides use, and what it says a mode sends is what both sides send and expect.
Because a segment boundary falls on a multiple of every allowed
``key_block``, per-channel key blocks never straddle segments and the decoded KV does
not depend on how prefill chunked the prompt.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from lynx.codec import CodecConfig, KVLayout, segment_nbytes
from lynx.codec.format import CONFIG_WIRE_NBYTES
from lynx.mode import Mode

PROTOCOL_VERSION = 1
TAG = b"LYNX1"
SEGMENT_TOKENS = 256
"""Tokens per encoded segment: a multiple of every allowed ``key_block`` (<= 256)."""

_MODE_CODES: dict[Mode, int] = {Mode.FULL: 0, Mode.ANCHOR_ONLY: 1, Mode.SPECULATIVE: 2}
_HANDSHAKE_HEAD = struct.Struct("<4sBB")
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))  # frozen; a name is accepted

    def to_wire(self) -> bytes:
        head = _HANDSHAKE_HEAD.pack(_HANDSHAKE_MAGIC, PROTOCOL_VERSION, _MODE_CODES[self.mode])
        return head + self.codec.to_wire() + self.layout.to_wire()

    @classmethod
    def from_wire(cls, data: bytes) -> Handshake:
        size = _HANDSHAKE_HEAD.size
        if len(data) < size:
            raise ProtocolError(f"Lynx handshake is {len(data)} bytes, too short")
        magic, version, mode = _HANDSHAKE_HEAD.unpack_from(data)
        if magic != _HANDSHAKE_MAGIC:
            raise ProtocolError(f"not a Lynx handshake (magic {magic!r})")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"peer speaks Lynx protocol v{version}, this server v{PROTOCOL_VERSION}")
        modes = {code: name for name, code in _MODE_CODES.items()}
        if mode not in modes:
            raise ProtocolError(f"unknown Lynx mode code {mode}")
        codec_wire = data[size : size + CONFIG_WIRE_NBYTES]
        layout_wire = data[size + CONFIG_WIRE_NBYTES :]
        return cls(modes[mode], CodecConfig.from_wire(codec_wire), KVLayout.from_wire(layout_wire))

    def describe(self) -> str:
        c, lay = self.codec, self.layout
        return (
            f"mode={self.mode} anchor_bits={c.anchor_bits} group_size={c.group_size} "
            f"residual={c.residual} key_layout={c.key_layout} key_block={c.key_block} "
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
    """Tokens ``[start, end)`` of a request and where their bytes sit in its regions."""

    start: int
    end: int
    anchor_offset: int
    anchor_nbytes: int
    residual_offset: int
    residual_nbytes: int


class RequestLayout:
    """The segments of a request of ``n_tokens`` tokens and the streams its mode sends;
    the same on both sides.

    Both regions are laid out (prefill encodes the Residual whatever the mode), but only
    :attr:`streams` travel: ``sent_residual_nbytes`` is 0 when the mode sends no Residual,
    and decode reserves only :attr:`receive_nbytes`.
    """

    def __init__(self, layout: KVLayout, config: CodecConfig, n_tokens: int, mode: Mode) -> None:
        if n_tokens <= 0:
            raise ValueError(f"a Lynx transfer needs at least one token, got {n_tokens}")
        self.n_tokens = n_tokens
        self.mode = mode
        self.segments: list[Segment] = []
        anchor_at = residual_at = 0
        for start in range(0, n_tokens, SEGMENT_TOKENS):
            end = min(start + SEGMENT_TOKENS, n_tokens)
            anchor, residual = segment_nbytes(layout, end - start, config)
            self.segments.append(Segment(start, end, anchor_at, anchor, residual_at, residual))
            anchor_at += anchor
            residual_at += residual
        self.anchor_nbytes = anchor_at
        self.residual_nbytes = residual_at

    @classmethod
    def of(cls, handshake: Handshake, n_tokens: int) -> RequestLayout:
        return cls(handshake.layout, handshake.codec, n_tokens, handshake.mode)

    @property
    def streams(self) -> tuple[Stream, ...]:
        return (Stream.ANCHOR, Stream.RESIDUAL) if self.mode.sends_residual else (Stream.ANCHOR,)

    @property
    def sent_residual_nbytes(self) -> int:
        return self.residual_nbytes if self.mode.sends_residual else 0

    @property
    def encoded_nbytes(self) -> int:
        """Send-buffer bytes: both regions."""
        return self.anchor_nbytes + self.residual_nbytes

    @property
    def receive_nbytes(self) -> int:
        """Receive-buffer bytes: the streams that travel."""
        return self.anchor_nbytes + self.sent_residual_nbytes

    def ready(self, tokens_available: int, *, last: bool) -> list[Segment]:
        """Segments wholly inside the first ``tokens_available`` tokens (all if last)."""
        if last:
            return list(self.segments)
        return [s for s in self.segments if s.end <= tokens_available]


def bytes_per_token(layout: KVLayout, config: CodecConfig) -> tuple[float, float]:
    """(Anchor, Residual) bytes per token of a full segment."""
    anchor, residual = segment_nbytes(layout, SEGMENT_TOKENS, config)
    return anchor / SEGMENT_TOKENS, residual / SEGMENT_TOKENS
