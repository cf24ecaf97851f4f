"""Lynx's control messages between a prefill and a decode server (protocol v7).

SGLang's Mooncake connector already carries, over ZMQ, a per-request metadata message
from decode to prefill (the room, decode's page ids, the aux slot) and status messages
from prefill to decode. Lynx adds:

* an **offer**, appended to decode's per-request metadata message as two trailing frames
  ``[TAG, offer bytes]``: decode's settings handshake, the reservation's nonce, where the
  request's Anchor and Residual may be written in decode's receive buffer, and how many
  tokens they cover. Upstream's parser reads frames by position and ignores trailing
  ones, so a prefill without Lynx still serves the request (and decode notices: no
  ACCEPT comes back);
* **notices** from prefill to decode, each a message ``[TAG, kind, payload]`` on the same
  ZMQ endpoint as upstream's status messages: ``ACCEPT`` (prefill's handshake, it will
  send Lynx bytes), ``REJECT`` (why it will not), ``LAYERS`` (the Residual of the
  request's first layers has landed, so decode may refine them while the rest travels),
  ``LANDED`` (one stream of the request has settled: every byte landed, or it failed) and
  ``RELEASED`` (prefill holds no more writes in flight to the request's receive space,
  which decode may then reuse).

**Reservations.** A room (upstream's ``bootstrap_room``) names a request, but a room id is
only as unique as the peers that chose it, and it is reused. So decode draws a random
64-bit **nonce** for each reservation of receive space and sends it in the offer; every
notice echoes the room *and* the nonce, and decode applies a notice only to the live
reservation with both (any other is dropped and counted: forged, misdirected, or late for
a reservation that ended). Prefill answers an offer only once it has a request for the
room, and only when the offer's token count is its own.

Every integer is little-endian. The layouts, pinned by ``test/unit/test_transfer_protocol.py``:

=========  =====================================================================
handshake  ``<4sBBBII8s`` magic ``b"LXHS"``, PROTOCOL_VERSION (6), mode code (0 full,
           1 anchor-only, 2 speculative), flags (bit 0: checksums; any other bit set
           is refused), protect_first, protect_last (tokens), the id of the key the
           side signs with (``AuthKey.key_id``; 8 zero bytes: it signs nothing); then
           the codec's ``CodecConfig.to_wire()`` (11 bytes) and ``KVLayout.to_wire()``
           (11 bytes): 45 bytes
offer      ``<H`` handshake length, handshake, ``<QQQQQQ`` nonce, anchor address,
           anchor bytes, residual address, residual bytes (0 and 0 when no Residual
           stream travels), tokens; signed: then the MAC (32 bytes)
ACCEPT     ``<QQ`` room, nonce, handshake
REJECT     ``<QQ`` room, nonce, UTF-8 reason
LAYERS     ``<QQHHI`` room, nonce, layers ``first`` and ``n`` (``first`` the previous
           LAYERS' ``n``, 0 at first; first < n < the layout's layers), checksum
           count ``c``; ``c`` x ``<I``: the Residual bytes of layers ``[0, n)`` of
           every segment on the Residual stream have landed
           (``lynx.codec.residual_layer_ends``), and these are the checksums of each
           layer in ``[first, n)`` of each such segment, layer by layer (``c`` is 0
           with checksums off); LANDED says the rest
LANDED     ``<QQBBQI`` room, nonce, stream (0 Anchor, 1 Residual), ok (1/0), bytes
           landed, checksum count ``n``; ``n`` x ``<I`` the stream's segment checksums
           (below; ``n`` is 0 when ok is 0 or checksums are off); UTF-8 error
RELEASED   ``<QQ`` room, nonce
=========  =====================================================================

**Rooms** are upstream's ``bootstrap_room``: an integer in ``[0, 2**64)`` (``ROOM_LIMIT``),
a ``<Q`` on the wire. :func:`check_room` refuses any other, naming it, at every entry that
takes a room from a peer or a client.

**Signatures** (opt-in: a server started with ``--lynx-auth-key-file``, see
:mod:`lynx.transfer.auth`). A signed message is its unsigned form followed by an
HMAC-SHA256: an offer's 32 bytes close the offer, over ``b"OFFER"``, where its KV and
notices go (:class:`OfferBinding`, from upstream's metadata frames, which the offer does
not repeat: ``<QHHH`` room, the lengths of decode's Mooncake session name and notice host,
the notice port, then those two names in ASCII) and the offer's fields before the MAC;
prefill checks it against the frames it received, so a captured offer cannot be re-sent
naming another session or notice endpoint. A notice's MAC is a fourth frame ``[TAG,
kind, payload, MAC]``, over the kind and the payload (room, nonce and every field). A
server with a key drops every message without its MAC (a metadata message without an
offer included); one without a key ignores a MAC, having nothing to check it with.

v7 bound the offer's MAC to decode's session and notice endpoint and limited an offer's
handshake to ``HANDSHAKE_MAX_NBYTES``; v6 added LAYERS: prefill sends the Residual stream
layer by layer (each segment's first layer, then each one's next, ...; its earlier
chunks' Residuals may go whole before that) and reports each prefix of layers that
landed; v5 added the key id to the handshake and the signatures; v4 let a segment's Residual
travel shorter than its space (the codec's lossless ``exact`` Residual, codec wire
version 2): LANDED counts the bytes that travelled; v3
added the nonce, the checksums and the handshake's flags byte; v2 added the
protected-token counts to the handshake (v1: the 6-byte head ``<4sBB``). Magic, version
and mode lead the handshake in every version, so an older peer is refused by name
(``peer speaks Lynx protocol v2``), also from an offer of another version.

**Checksums** (:func:`span_checksum`; only with the handshake's checksums flag, which
both sides must set alike). The bytes each segment puts on a stream (its Anchor; for a
protected segment its Anchor and Residual, which sit back to back; an unprotected
segment's Residual on the Residual stream) are one contiguous range, a multiple of 16
bytes long; a LAYERS notice's ranges (one layer's bytes of a segment's Residual) may have
any length. A range's checksum, read from its first byte as little-endian 32-bit words
``w_i`` (the last one zero-padded), is ``sum((2 * (i // 1024) + 1) * w_i) mod 2**32``: a
sum of 4 KiB blocks weighted by odd block numbers. Prefill computes it as it encodes, on
the encoding device (torch ops, one pass over each chunk's newly encoded segments, before
the lanes read them); decode checks every range before it decodes any into the KV pool.
Strength: a change of one word is always caught (an odd weight times a non-zero difference is non-zero mod
2**32); random bytes, a stale range left by another request, a lost or repeated write,
or 4 KiB blocks written at another block's offset pass with probability about 2**-32; a
permutation of words inside one 4 KiB block passes. It is not a MAC: it catches
corruption and misplaced or missing bytes, not a prefill that lies on purpose.

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
  decoded KV does not depend on how prefill chunked the prompt;
* with a variable-length Residual (``CodecConfig.residual_is_variable``) every segment
  keeps its place, sized for its largest Residual, but only the bytes its Residual takes
  travel (the codec writes that count in the Residual's first word,
  ``lynx.codec.residual_nbytes_of``): a stream carrying Residuals then sends at most
  ``sent_nbytes()``, and each segment's range on it ends where its Residual does.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lynx.codec import CodecConfig, CodecInputError, KVLayout, residual_nbytes_of, segment_nbytes
from lynx.codec.format import CONFIG_WIRE_NBYTES
from lynx.mode import Mode
from lynx.transfer.auth import KEY_ID_NBYTES, MAC_NBYTES, NO_KEY, AuthKey

PROTOCOL_VERSION = 7
TAG = b"LYNX1"
SEGMENT_TOKENS = 256
"""Tokens per encoded segment: a multiple of every allowed ``key_block`` (<= 256)."""
CHECKSUM_BLOCK_WORDS = 1024
"""32-bit words per weighted block of :func:`span_checksum` (4 KiB)."""
ROOM_LIMIT = 1 << 64
"""Rooms are ``[0, ROOM_LIMIT)``: a u64 in every message."""
HANDSHAKE_MAX_NBYTES = 256
"""The longest handshake an offer may carry (this version's is 45 bytes): an offer held
for a room with no request yet costs prefill no more than this and the offer's fixed part."""
NOTICE_TEXT_MAX = 4096
"""Most bytes of a notice's free-form part (an ACCEPT's handshake, a REJECT's reason, a
LANDED's error) that a receiver reads: a sender cuts longer text."""

_MODE_CODES: dict[Mode, int] = {Mode.FULL: 0, Mode.ANCHOR_ONLY: 1, Mode.SPECULATIVE: 2}
# Magic, version and mode lead in every protocol version, so that any peer's version is
# read and named; what follows is this version's.
_HANDSHAKE_HEAD = struct.Struct("<4sBB")
_HANDSHAKE_BODY = struct.Struct(f"<BII{KEY_ID_NBYTES}s")  # flags, protect_first, protect_last, key id
_FLAG_CHECKSUMS = 0x01
_HANDSHAKE_MAGIC = b"LXHS"
_OFFER_HEAD = struct.Struct("<H")
_OFFER_BODY = struct.Struct("<QQQQQQ")
_RESERVATION = struct.Struct("<QQ")  # room, nonce: the head of every notice
_OFFER_LABEL = b"OFFER"
_BINDING_HEAD = struct.Struct("<QHHH")  # room, session length, host length, port
_LANDED = struct.Struct("<QQBBQI")
_LAYERS = struct.Struct("<QQHHI")
_CHECKSUM = struct.Struct("<I")


class ProtocolError(ValueError):
    """A Lynx control message that cannot be parsed (another version, or corrupt)."""


class RoomError(ProtocolError):
    """A room (``bootstrap_room``) outside ``[0, ROOM_LIMIT)``: no Lynx message can name it."""


def check_room(room: int) -> int:
    """``room``, if it is one Lynx can carry; RoomError naming it otherwise."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < ROOM_LIMIT:
        raise RoomError(
            f"room {room!r} (bootstrap_room) is not an integer in 0..2**64-1: Lynx carries rooms as u64"
        )
    return room


@dataclass(frozen=True)
class OfferBinding:
    """Where an offer's request sends its KV and its notices: the room, decode's Mooncake
    ``session`` (the engine prefill writes to) and its control ``endpoint`` (host, port),
    as upstream's metadata message carries them. An offer's MAC covers it."""

    room: int
    session: str
    endpoint: tuple[str, int]

    def to_bytes(self) -> bytes:
        """The binding as the MAC covers it; ProtocolError for a field no message carries."""
        host, port = self.endpoint
        try:
            session_b, host_b = self.session.encode("ascii"), host.encode("ascii")
        except UnicodeEncodeError:
            raise ProtocolError("a session or host name that is not ASCII") from None
        if len(session_b) > 0xFFFF or len(host_b) > 0xFFFF or not 0 <= port <= 0xFFFF:
            raise ProtocolError(f"an offer bound to session {self.session[:64]!r}, {host[:64]}:{port}")
        return (
            _BINDING_HEAD.pack(check_room(self.room), len(session_b), len(host_b), port) + session_b + host_b
        )


class NoticeKind(enum.Enum):
    ACCEPT = b"ACCEPT"
    REJECT = b"REJECT"
    LANDED = b"LANDED"
    RELEASED = b"RELEASED"
    LAYERS = b"LAYERS"


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
    # LANDED carries a checksum of each segment, checked before decoding: one side cannot
    # check what the other does not send, so it is paired too.
    checksums: bool = False
    # The id of the key this side signs its messages with (NO_KEY: it signs nothing): a
    # side with a key drops what the other does not sign, so it is paired too.
    key_id: bytes = NO_KEY

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode.parse(self.mode))  # frozen; a name is accepted
        if not (0 <= self.protect_first < 1 << 32 and 0 <= self.protect_last < 1 << 32):
            raise ValueError(
                f"protected token counts must fit a u32, got {self.protect_first} and {self.protect_last}"
            )
        if len(self.key_id) != KEY_ID_NBYTES:
            raise ValueError(f"a key id is {KEY_ID_NBYTES} bytes, got {len(self.key_id)}")

    def signed_with(self, key: AuthKey | None) -> Handshake:
        """This handshake, naming ``key`` (None: no key) as the one its side signs with."""
        return dataclasses.replace(self, key_id=NO_KEY if key is None else key.key_id)

    def to_wire(self) -> bytes:
        head = _HANDSHAKE_HEAD.pack(_HANDSHAKE_MAGIC, PROTOCOL_VERSION, _MODE_CODES[self.mode])
        flags = _FLAG_CHECKSUMS if self.checksums else 0
        body = _HANDSHAKE_BODY.pack(flags, self.protect_first, self.protect_last, self.key_id)
        return head + body + self.codec.to_wire() + self.layout.to_wire()

    @classmethod
    def from_wire(cls, data: bytes) -> Handshake:
        size = _HANDSHAKE_HEAD.size + _HANDSHAKE_BODY.size
        mode = _handshake_mode_code(data)
        modes = {code: name for name, code in _MODE_CODES.items()}
        if mode not in modes:
            raise ProtocolError(f"unknown Lynx mode code {mode}")
        if len(data) < size:
            raise ProtocolError(f"Lynx handshake is {len(data)} bytes, too short")
        flags, protect_first, protect_last, key_id = _HANDSHAKE_BODY.unpack_from(data, _HANDSHAKE_HEAD.size)
        if flags & ~_FLAG_CHECKSUMS:
            raise ProtocolError(f"unknown Lynx handshake flags {flags:#04x}")
        codec_wire = data[size : size + CONFIG_WIRE_NBYTES]
        layout_wire = data[size + CONFIG_WIRE_NBYTES :]
        return cls(
            modes[mode],
            CodecConfig.from_wire(codec_wire),
            KVLayout.from_wire(layout_wire),
            protect_first,
            protect_last,
            bool(flags & _FLAG_CHECKSUMS),
            key_id,
        )

    @staticmethod
    def key_id_of(data: bytes) -> bytes:
        """The key id of a handshake, read at its fixed place without parsing the rest:
        what a peer claims to sign with, checked before its signature. ProtocolError
        naming the peer's version if it speaks another one, or if it is too short."""
        _handshake_mode_code(data)
        size = _HANDSHAKE_HEAD.size + _HANDSHAKE_BODY.size
        if len(data) < size:
            raise ProtocolError(f"Lynx handshake is {len(data)} bytes, too short")
        return data[size - KEY_ID_NBYTES : size]

    def describe(self) -> str:
        c, lay = self.codec, self.layout
        return (
            f"mode={self.mode} anchor_bits={c.anchor_bits} group_size={c.group_size} "
            f"residual={c.residual} key_layout={c.key_layout} key_block={c.key_block} "
            f"protect_first={self.protect_first} protect_last={self.protect_last} "
            f"checksums={'on' if self.checksums else 'off'} "
            f"signed={_key_name(self.key_id)} "
            f"kv=[{lay.num_layers} layers x {lay.num_kv_heads} heads x {lay.head_dim}, "
            f"{str(lay.dtype).removeprefix('torch.')}]"
        )

    def mismatch(self, peer: Handshake, *, this: str, other: str) -> str | None:
        """None if the two agree, else a message naming both sides' settings."""
        if peer == self:
            return None
        if dataclasses.replace(peer, key_id=self.key_id) == self:
            return key_mismatch(self.key_id, peer.key_id, this=this, other=other)
        heads = dataclasses.replace(peer.layout, num_kv_heads=self.layout.num_kv_heads)
        if dataclasses.replace(peer, layout=heads) == self:
            hint = (
                "only the KV heads per rank differ: the servers split the heads over different "
                "--tp-size, and Lynx needs the same TP size on prefill and decode"
            )
        else:
            hint = "start both servers with the same --lynx-* flags and the same model and KV dtype"
        sides = f"{this} ({self.describe()}) and {other} ({peer.describe()})"
        return f"Lynx settings differ between {sides}: {hint}"


def _key_name(key_id: bytes) -> str:
    return "no" if key_id == NO_KEY else f"key {key_id.hex()}"


def key_mismatch(mine: bytes, theirs: bytes, *, this: str, other: str) -> str:
    """Why two sides whose key ids differ cannot pair (``this`` signs with ``mine``)."""
    if NO_KEY in (mine, theirs):
        signer, plain = (this, other) if theirs == NO_KEY else (other, this)
        return (
            f"{signer} signs its Lynx messages (--lynx-auth-key-file), {plain} does not: "
            "give both servers the same key file, or neither"
        )
    return (
        f"{this} and {other} sign their Lynx messages with different keys (--lynx-auth-key-file; "
        f"key ids {mine.hex()} and {theirs.hex()}): give both servers the same key file"
    )


def _handshake_mode_code(data: bytes) -> int:
    """The mode code of a handshake of this protocol version; ProtocolError naming the
    peer's version otherwise (the head is the same in every version)."""
    if len(data) < _HANDSHAKE_HEAD.size:
        raise ProtocolError(f"Lynx handshake is {len(data)} bytes, too short")
    magic, version, mode = _HANDSHAKE_HEAD.unpack_from(data)
    if magic != _HANDSHAKE_MAGIC:
        raise ProtocolError(f"not a Lynx handshake (magic {magic!r})")
    if version != PROTOCOL_VERSION:
        raise _version_error(version)
    return int(mode)


def _version_error(version: int) -> ProtocolError:
    return ProtocolError(f"peer speaks Lynx protocol v{version}, this server v{PROTOCOL_VERSION}")


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
    """Decode's receive space for one request, appended to its metadata message.
    ``nonce`` names the reservation: prefill echoes it in every notice."""

    handshake: bytes
    nonce: int
    anchor_addr: int
    anchor_nbytes: int
    residual_addr: int
    residual_nbytes: int
    n_tokens: int
    mac: bytes = b""  # b"": unsigned (:meth:`signed`)

    def signed(self, key: AuthKey, binding: OfferBinding) -> Offer:
        """This offer with ``key``'s MAC over its fields and ``binding``."""
        return dataclasses.replace(self, mac=key.mac(_OFFER_LABEL, binding.to_bytes() + self._fields()))

    def verify(self, key: AuthKey, binding: OfferBinding) -> bool:
        """Whether the offer carries ``key``'s MAC over its fields and ``binding`` (False
        for a binding no signer could have covered)."""
        try:
            bound = binding.to_bytes()
        except ProtocolError:
            return False
        return bool(self.mac) and key.verify(_OFFER_LABEL, bound + self._fields(), self.mac)

    def to_wire(self) -> bytes:
        return self._fields() + self.mac

    def _fields(self) -> bytes:
        body = _OFFER_BODY.pack(
            self.nonce,
            self.anchor_addr,
            self.anchor_nbytes,
            self.residual_addr,
            self.residual_nbytes,
            self.n_tokens,
        )
        return _OFFER_HEAD.pack(len(self.handshake)) + self.handshake + body

    @classmethod
    def from_wire(cls, data: bytes) -> Offer:
        try:
            (n,) = _OFFER_HEAD.unpack_from(data)
        except struct.error:
            raise ProtocolError(f"malformed Lynx offer ({len(data)} bytes)") from None
        # The lengths are checked before anything is copied out of a peer's frame.
        if n > HANDSHAKE_MAX_NBYTES:
            raise ProtocolError(f"a Lynx offer whose handshake is {n} bytes, at most {HANDSHAKE_MAX_NBYTES}")
        mac_nbytes = len(data) - _OFFER_HEAD.size - n - _OFFER_BODY.size
        if mac_nbytes not in (0, MAC_NBYTES):
            if len(data) >= _OFFER_HEAD.size + n >= _OFFER_HEAD.size + _HANDSHAKE_HEAD.size:
                magic, version, _ = _HANDSHAKE_HEAD.unpack_from(data, _OFFER_HEAD.size)
                if magic == _HANDSHAKE_MAGIC and version != PROTOCOL_VERSION:
                    raise _version_error(version)  # another version's offer: name it
            raise ProtocolError(f"malformed Lynx offer ({len(data)} bytes)")
        body_at = _OFFER_HEAD.size + n
        handshake = data[_OFFER_HEAD.size : body_at]
        mac = data[body_at + _OFFER_BODY.size :]
        return cls(handshake, *_OFFER_BODY.unpack_from(data, body_at), mac=mac)

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
    """A prefill -> decode message about one reservation: ``room`` and the offer's
    ``nonce``."""

    kind: NoticeKind
    room: int
    nonce: int
    handshake: bytes = b""  # ACCEPT
    text: str = ""  # REJECT reason, LANDED error
    stream: Stream = Stream.ANCHOR  # LANDED
    ok: bool = True  # LANDED
    nbytes: int = 0  # LANDED
    # LANDED: span_checksum of each of the stream's segments; LAYERS: of each segment's
    # bytes of each layer it reports, layer by layer
    checksums: tuple[int, ...] = ()
    layers: int = 0  # LAYERS: the Residual of layers [0, layers) landed
    first_layer: int = 0  # LAYERS: ... and its checksums are those of layers [first_layer, layers)

    def to_frames(self, key: AuthKey | None = None) -> list[bytes]:
        """The notice's frames, signed with ``key`` (a fourth frame) unless it is None."""
        head = _RESERVATION.pack(self.room, self.nonce)
        # whole UTF-8 characters, at most NOTICE_TEXT_MAX bytes: what a receiver reads
        text = self.text.encode()[:NOTICE_TEXT_MAX].decode(errors="ignore").encode()
        if self.kind is NoticeKind.ACCEPT:
            payload = head + self.handshake
        elif self.kind is NoticeKind.REJECT:
            payload = head + text
        elif self.kind is NoticeKind.LANDED:
            landed = _LANDED.pack(
                self.room, self.nonce, int(self.stream), int(self.ok), self.nbytes, len(self.checksums)
            )
            checksums = b"".join(_CHECKSUM.pack(c) for c in self.checksums)
            payload = landed + checksums + text
        elif self.kind is NoticeKind.LAYERS:
            layers = _LAYERS.pack(self.room, self.nonce, self.first_layer, self.layers, len(self.checksums))
            payload = layers + b"".join(_CHECKSUM.pack(c) for c in self.checksums)
        else:
            payload = head
        frames = [TAG, self.kind.value, payload]
        return frames if key is None else [*frames, key.mac(self.kind.value, payload)]

    @staticmethod
    def head_of(frames: list[bytes]) -> tuple[NoticeKind, int, int]:
        """(kind, room, nonce) of a notice, from its fixed head alone: nothing of its
        variable part is read, so that a notice is authenticated before it is parsed."""
        if len(frames) not in (3, 4) or frames[0] != TAG:
            raise ProtocolError(f"not a Lynx notice ({len(frames)} frames)")
        if len(frames) == 4 and len(frames[3]) != MAC_NBYTES:
            raise ProtocolError(f"a Lynx notice's MAC is {MAC_NBYTES} bytes, got {len(frames[3])}")
        try:
            kind = NoticeKind(frames[1])
        except ValueError:
            raise ProtocolError(f"unknown Lynx notice {frames[1]!r}") from None
        if len(frames[2]) < _RESERVATION.size:
            raise ProtocolError(f"malformed Lynx {kind.name} notice")
        room, nonce = _RESERVATION.unpack_from(frames[2])
        return kind, room, nonce

    @classmethod
    def from_frames(cls, frames: list[bytes], max_checksums: int | None = None, layers: int = 1) -> Notice:
        """The whole notice. ``max_checksums``: the most checksums a LANDED of its
        reservation's plan carries (its segments), a LAYERS ``layers`` times as many (its
        layers); a notice longer than :func:`notice_nbytes_max` of that, or claiming more,
        raises ProtocolError before any of its variable part is read."""
        kind, _, _ = cls.head_of(frames)
        payload = frames[2]
        most = None if max_checksums is None else max_checksums * (layers if kind is NoticeKind.LAYERS else 1)
        if most is not None and len(payload) > notice_nbytes_max(most):
            raise ProtocolError(
                f"a {kind.name} notice of {len(payload)} bytes, at most {notice_nbytes_max(most)} "
                "for this reservation"
            )
        try:
            if kind is NoticeKind.LANDED:
                room, nonce, stream, ok, nbytes, count = _LANDED.unpack_from(payload)
                checksums, end = _checksums_after(payload, _LANDED.size, count, most, kind)
                text = payload[end:].decode()
                return cls(
                    kind,
                    room,
                    nonce,
                    text=text,
                    stream=Stream(stream),
                    ok=bool(ok),
                    nbytes=nbytes,
                    checksums=checksums,
                )
            if kind is NoticeKind.LAYERS:
                room, nonce, first, layers, count = _LAYERS.unpack_from(payload)
                checksums, end = _checksums_after(payload, _LAYERS.size, count, most, kind)
                if end != len(payload):
                    raise struct.error("bytes after a LAYERS notice's checksums")
                return cls(kind, room, nonce, layers=layers, first_layer=first, checksums=checksums)
            room, nonce = _RESERVATION.unpack_from(payload)
            rest = payload[_RESERVATION.size :]
        except ProtocolError:
            raise
        except (struct.error, ValueError, UnicodeDecodeError):
            raise ProtocolError(f"malformed Lynx {kind.name} notice") from None
        if kind is NoticeKind.ACCEPT:
            return cls(kind, room, nonce, handshake=rest)
        if kind is NoticeKind.REJECT:
            return cls(kind, room, nonce, text=rest.decode(errors="replace"))
        return cls(kind, room, nonce)


def _checksums_after(
    payload: bytes, at: int, count: int, max_checksums: int | None, kind: NoticeKind
) -> tuple[tuple[int, ...], int]:
    """The ``count`` checksums of a notice's payload from byte ``at``, and where they end;
    ProtocolError for more than ``max_checksums``, struct.error beyond the payload."""
    if max_checksums is not None and count > max_checksums:
        what = "segments" if kind is NoticeKind.LANDED else "segments' layers"
        raise ProtocolError(
            f"a {kind.name} notice with {count} checksums, this request has {max_checksums} {what}"
        )
    end = at + count * _CHECKSUM.size
    if len(payload) < end:
        raise struct.error("checksums beyond the payload")
    return tuple(c for (c,) in _CHECKSUM.iter_unpack(payload[at:end])), end


def is_notice(frames: list[bytes]) -> bool:
    return bool(frames) and frames[0] == TAG


def unsigned_reason(frames: list[bytes], key: AuthKey) -> str | None:
    """None if the notice ``frames`` (whose :meth:`Notice.head_of` parsed) carry ``key``'s
    MAC over their kind and payload, else why not: ``"unsigned"`` (no MAC) or
    ``"bad_signature"`` (another key's, or a forger's). Reads the payload as bytes only."""
    if len(frames) < 4:
        return "unsigned"
    return None if key.verify(frames[1], frames[2], frames[3]) else "bad_signature"


def notice_nbytes_max(checksums: int) -> int:
    """The longest legal payload of a notice carrying at most ``checksums`` checksums."""
    return max(_LANDED.size, _LAYERS.size) + checksums * _CHECKSUM.size + NOTICE_TEXT_MAX


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
    region followed by its Residual region. Both regions are laid out in every mode (prefill
    codes only the Residuals that travel), but only :attr:`streams` travel:
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
        self.n_tokens = n_tokens
        self.mode = mode
        self.residual_is_variable = config.residual_is_variable
        self._layout, self._config = layout, config
        self.protect_until, self.protect_from = _protected_bounds(
            config, n_tokens, protect_first, protect_last
        )
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

    @staticmethod
    def sent_nbytes_of(handshake: Handshake, n_tokens: int) -> dict[Stream, int]:
        """What :meth:`sent_nbytes` of ``RequestLayout.of(handshake, n_tokens)`` is, by
        arithmetic: a few ``segment_nbytes`` calls whatever ``n_tokens`` is, and nothing
        allocated, so that a peer's count can be checked before any layout is built."""
        config, layout = handshake.codec, handshake.layout
        until, since = _protected_bounds(config, n_tokens, handshake.protect_first, handshake.protect_last)

        def nbytes(start: int, end: int) -> tuple[int, int]:
            """(Anchor, Residual) bytes of the segments of tokens [start, end)."""
            total = [0, 0]
            for length, count in _segment_lengths(start, end):
                for i, part in enumerate(segment_nbytes(layout, length, config)):
                    total[i] += count * part
            return total[0], total[1]

        head, middle, tail = nbytes(0, until), nbytes(until, since), nbytes(since, n_tokens)
        anchor = sum(head) + middle[0] + sum(tail)
        sends_residual = handshake.mode.sends_residual and until < n_tokens
        return {Stream.ANCHOR: anchor, Stream.RESIDUAL: middle[1] if sends_residual else 0}

    @staticmethod
    def most_segments(handshake: Handshake, nbytes: int) -> int:
        """The most segments of a request whose receive space fits in ``nbytes``: every
        segment but the last and the (at most four) beside the two protection bounds is
        SEGMENT_TOKENS long, and its Anchor alone takes a full segment's Anchor bytes."""
        full = segment_nbytes(handshake.layout, SEGMENT_TOKENS, handshake.codec)[0]
        return nbytes // full + 5

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

    def sent_nbytes(self) -> dict[Stream, int]:
        """Bytes on each stream, 0 for one that does not travel; the most a stream of
        :attr:`variable_streams` sends."""
        return {Stream.ANCHOR: self.anchor_nbytes, Stream.RESIDUAL: self.sent_residual_nbytes}

    @property
    def variable_streams(self) -> frozenset[Stream]:
        """The streams that send fewer bytes than their space when Residuals code short:
        those carrying a variable-length Residual (the Anchor stream carries the protected
        segments')."""
        if not self.residual_is_variable:
            return frozenset()
        carried = {seg.residual_stream for seg in self.segments}
        return frozenset(stream for stream in self.streams if stream in carried)

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

    @property
    def num_layers(self) -> int:
        return self._layout.num_layers

    def anchor_layers(self, seg: Segment, first: int, end: int) -> slice:
        """The bytes of ``seg``'s Anchor that hold layers ``[first, end)`` (their K and V
        parts), in the request's space: the format lays a segment's parts out in layer
        order, each layer's the same size."""
        per_layer = seg.anchor_nbytes // self._layout.num_layers
        return slice(seg.anchor_offset + first * per_layer, seg.anchor_offset + end * per_layer)

    def sent_ranges(self, seg: Segment, residual_nbytes: int | None = None) -> list[tuple[Stream, slice]]:
        """The bytes of ``seg`` that travel, one contiguous range per stream (a protected
        segment's Residual follows its Anchor): (stream, range in the request's space).
        ``residual_nbytes``: how many of its Residual's bytes travel (a variable-length
        Residual's own count; default all of its space)."""
        anchor, residual = self.byte_ranges(seg)
        if residual_nbytes is not None:
            if not 0 < residual_nbytes <= seg.residual_nbytes:
                raise ValueError(
                    f"a Residual of {residual_nbytes} bytes for tokens [{seg.start}, {seg.end}), "
                    f"whose space holds {seg.residual_nbytes}"
                )
            residual = slice(residual.start, residual.start + residual_nbytes)
        if seg.protected:
            return [(Stream.ANCHOR, slice(anchor.start, residual.stop))]
        ranges = [(Stream.ANCHOR, anchor)]
        if Stream.RESIDUAL in self.streams:
            ranges.append((Stream.RESIDUAL, residual))
        return ranges

    def residual_nbytes_in(
        self, space: torch.Tensor, streams: Sequence[Stream] = tuple(Stream)
    ) -> list[int | None] | None:
        """Each segment's travelling Residual bytes, read from the request's ``space``
        (its Anchor region, then its Residual region) for the segments whose Residual is
        on ``streams`` (None for the others); None when Residuals have a fixed size.
        CodecInputError (from the codec) for a Residual whose count is not a possible one."""
        if not self.residual_is_variable:
            return None
        counts: list[int | None] = []
        for seg in self.segments:
            if seg.residual_stream not in streams:
                counts.append(None)
                continue
            try:
                counts.append(
                    residual_nbytes_of(
                        space[self.byte_ranges(seg)[1]], seg.end - seg.start, self._layout, self._config
                    )
                )
            except CodecInputError as exc:
                raise CodecInputError(f"the Residual of tokens [{seg.start}, {seg.end}): {exc}") from exc
        return counts

    def stream_ranges(
        self, stream: Stream, residual_nbytes: Sequence[int] | None = None
    ) -> list[tuple[Segment, slice]]:
        """Each segment's range on ``stream``, in order: what one checksum covers.
        ``residual_nbytes``: each segment's travelling Residual bytes (``sent_ranges``)."""
        counts = residual_nbytes or [None] * len(self.segments)
        return [
            (seg, span)
            for seg, count in zip(self.segments, counts, strict=True)
            for s, span in self.sent_ranges(seg, count)
            if s is stream
        ]

    def ready(self, tokens_available: int, *, last: bool) -> list[Segment]:
        """Segments wholly inside the first ``tokens_available`` tokens (all if last)."""
        if last:
            return list(self.segments)
        return [s for s in self.segments if s.end <= tokens_available]


def _protected_bounds(config: CodecConfig, n_tokens: int, first: int, last: int) -> tuple[int, int]:
    """(protect_until, protect_from) of a request: see :class:`RequestLayout`."""
    if n_tokens <= 0:
        raise ValueError(f"a Lynx transfer needs at least one token, got {n_tokens}")
    # Per-channel key groups span key_block tokens from a segment's start. Bounds on
    # that grid (counted from the request's start) keep every unprotected token in the
    # key group, so at the Anchor value, it has with nothing protected, and add no
    # partial group.
    block = config.key_block if config.key_layout == "per_channel" else 1
    until = min(n_tokens, -(-first // block) * block)
    since = max(0, (n_tokens - last) // block * block) if last else n_tokens
    return (until, since) if until < since else (n_tokens, n_tokens)


def _segment_lengths(start: int, end: int) -> list[tuple[int, int]]:
    """(length, how many) of the segments that tokens [start, end) are cut into at every
    multiple of SEGMENT_TOKENS: a head up to the first multiple, whole segments, a tail."""
    if start >= end:
        return []
    head_end = min(end, -(-start // SEGMENT_TOKENS) * SEGMENT_TOKENS)
    whole_end = max(head_end, end // SEGMENT_TOKENS * SEGMENT_TOKENS)
    pieces = [(head_end - start, 1), (SEGMENT_TOKENS, (whole_end - head_end) // SEGMENT_TOKENS)]
    pieces.append((end - whole_end, 1))
    return [(length, count) for length, count in pieces if length and count]


def span_checksum(span: torch.Tensor) -> torch.Tensor:
    """The checksum of a range of bytes (module docstring), as a 0-dim int32 tensor on
    the range's device: torch ops only, no synchronisation. :func:`checksum_values`
    turns a batch of them into the wire's u32 values. A range that does not start on a
    word or is not a whole number of words is read through a zero-padded copy."""
    if span.numel() % 4 or span.storage_offset() % 4:
        padded = torch.zeros(-(-span.numel() // 4) * 4, dtype=torch.uint8, device=span.device)
        padded[: span.numel()] = span
        span = padded
    words = span.view(torch.int32)
    blocks = words.numel() // CHECKSUM_BLOCK_WORDS
    whole = words[: blocks * CHECKSUM_BLOCK_WORDS].view(blocks, CHECKSUM_BLOCK_WORDS)
    # int32 arithmetic wraps: everything below is mod 2**32, as specified.
    odd = torch.arange(1, 2 * blocks + 1, 2, dtype=torch.int32, device=span.device)
    total = (whole.sum(1, dtype=torch.int32) * odd).sum(dtype=torch.int32)
    rest = words[blocks * CHECKSUM_BLOCK_WORDS :]
    if rest.numel():
        total = total + (2 * blocks + 1) * rest.sum(dtype=torch.int32)
    return total


def checksum_values(checksums: Sequence[torch.Tensor]) -> list[int]:
    """The u32 values of :func:`span_checksum` results (one device-to-host copy)."""
    if not checksums:
        return []
    return [value & 0xFFFFFFFF for value in torch.stack(list(checksums)).tolist()]


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
