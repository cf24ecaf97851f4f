"""Lynx's control messages (wire bytes pinned) and the per-request segment layout."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import struct
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx.codec import CodecConfig, KVLayout, decode, decode_pages, encode, encode_pages, segment_nbytes
from lynx.mode import Mode
from lynx.transfer import (
    PROTOCOL_VERSION,
    SEGMENT_TOKENS,
    Handshake,
    Notice,
    NoticeKind,
    Offer,
    OfferBinding,
    ProtocolError,
    RequestLayout,
    RoomError,
    Stream,
    check_room,
)
from lynx.transfer.auth import NO_KEY, AuthKey
from lynx.transfer.protocol import (
    CHECKSUM_BLOCK_WORDS,
    HANDSHAKE_MAX_NBYTES,
    NOTICE_TEXT_MAX,
    TAG,
    append_offer,
    bytes_per_token,
    checksum_values,
    is_notice,
    parse_handshake,
    protection_cost,
    span_checksum,
    split_offer,
    unsigned_reason,
)

LAYOUT = KVLayout(4, 2, 64, torch.bfloat16)
HANDSHAKE = Handshake("full", CodecConfig(), LAYOUT)
# Every field away from its default, so that each one is pinned by the golden bytes.
ODD = Handshake(
    "anchor-only",
    CodecConfig(anchor_bits=3, group_size=16, residual="int8", key_layout="per_token", key_block=32),
    KVLayout(28, 4, 128, torch.float16),
    protect_first=4,
    protect_last=300,
    checksums=True,
    key_id=bytes(range(1, 9)),
)
KEY = AuthKey(b"0123456789abcdef0123456789abcdef")
ROOM = 0x0102030405060708
ROOM_LE = "0807060504030201"
NONCE = 0x1112131415161718
NONCE_LE = "1817161514131211"


# ---- handshake ---------------------------------------------------------------------------------


def test_protocol_version_and_tag_are_pinned() -> None:
    assert PROTOCOL_VERSION == 7
    assert CHECKSUM_BLOCK_WORDS == 1024
    assert TAG == b"LYNX1"
    assert SEGMENT_TOKENS == 256


def test_handshake_wire_bytes_are_pinned() -> None:
    assert HANDSHAKE.to_wire().hex() == (
        "4c584853" "07" "00"  # b"LXHS", protocol v7, mode full
        "00"  # flags: no checksums
        "00000000" "00000000"  # protect_first 0, protect_last 0
        "0000000000000000"  # key id: signs nothing
        "4c5843" "03" "04" "2000" "01" "00" "1000"  # b"LXC" v3, 4 bits, group 32, exact, per_channel, 16
        "4c584c" "03" "0400" "0200" "4000" "00"  # b"LXL" v3, 4 layers, 2 heads, head_dim 64, bf16
    )  # fmt: skip
    assert ODD.to_wire().hex() == (
        "4c584853" "07" "01"  # anchor-only
        "01"  # flags: checksums
        "04000000" "2c010000"  # protect_first 4, protect_last 300
        "0102030405060708"  # key id
        "4c5843" "03" "03" "1000" "00" "01" "2000"  # 3 bits, group 16, int8, per_token, 32
        "4c584c" "03" "1c00" "0400" "8000" "01"  # 28 layers, 4 heads, head_dim 128, fp16
    )  # fmt: skip
    speculative = Handshake("speculative", CodecConfig(), LAYOUT).to_wire()
    assert speculative[5] == 2
    assert len(HANDSHAKE.to_wire()) == len(ODD.to_wire()) == 45


@pytest.mark.parametrize(
    "handshake",
    [
        HANDSHAKE,
        ODD,
        Handshake("speculative", CodecConfig(), LAYOUT, protect_first=1 << 16, protect_last=7),
        Handshake("full", CodecConfig(), LAYOUT, checksums=True),
    ],
)
def test_handshake_round_trips(handshake: Handshake) -> None:
    assert Handshake.from_wire(handshake.to_wire()) == handshake
    assert parse_handshake(handshake.to_wire()) == handshake


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w[:5], "too short"),
        (lambda w: b"LXHT" + w[4:], "not a Lynx handshake"),
        (lambda w: w[:4] + bytes([1]) + w[5:], "protocol v1, this server v7"),
        (lambda w: w[:4] + bytes([4]) + w[5:], "protocol v4, this server v7"),
        (lambda w: w[:4] + bytes([5]) + w[5:], "protocol v5, this server v7"),
        (lambda w: w[:4] + bytes([1]) + w[5:6], "protocol v1, this server v7"),  # any version's head
        (lambda w: w[:5] + bytes([9]) + w[6:], "unknown Lynx mode code 9"),
        (lambda w: w[:10], "10 bytes, too short"),  # truncated protection
        (lambda w: w[:6] + bytes([2]) + w[7:], "unknown Lynx handshake flags 0x02"),
        (lambda w: w[:6] + bytes([0x81]) + w[7:], "unknown Lynx handshake flags 0x81"),
    ],
)
def test_handshake_from_wire_errors(mutate, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        Handshake.from_wire(mutate(HANDSHAKE.to_wire()))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w[:-1],  # truncated layout
        lambda w: w + b"\0",  # trailing byte
        lambda w: w[:28],  # truncated codec settings
        lambda w: w[:23] + b"LXQ" + w[26:],  # the codec's own magic
        lambda w: w[:26] + bytes([7]) + w[27:],  # codec wire version
        lambda w: w[:-1] + bytes([9]),  # unknown dtype code
    ],
)
def test_parse_handshake_turns_codec_errors_into_protocol_errors(mutate) -> None:
    with pytest.raises(ProtocolError):
        parse_handshake(mutate(HANDSHAKE.to_wire()))


def test_mismatch_names_both_sides_settings() -> None:
    assert HANDSHAKE.mismatch(Handshake("full", CodecConfig(), LAYOUT), this="here", other="there") is None
    peer = Handshake("full", CodecConfig(anchor_bits=2), KVLayout(4, 2, 64, torch.float16))
    message = HANDSHAKE.mismatch(peer, this="this decode server", other="prefill p:1")
    assert message is not None
    assert "this decode server (mode=full anchor_bits=4 " in message
    assert "prefill p:1 (mode=full anchor_bits=2 " in message
    assert "kv=[4 layers x 2 heads x 64, bfloat16]" in message
    assert "kv=[4 layers x 2 heads x 64, float16]" in message
    assert "--lynx-*" in message
    other_mode = Handshake("anchor-only", CodecConfig(), LAYOUT)
    message = HANDSHAKE.mismatch(other_mode, this="a", other="b")
    assert message is not None and "mode=full" in message and "mode=anchor-only" in message
    protected = Handshake("full", CodecConfig(), LAYOUT, protect_first=4, protect_last=64)
    message = HANDSHAKE.mismatch(protected, this="a", other="b")
    assert message is not None
    assert "a (mode=full " in message and "protect_first=0 protect_last=0" in message
    assert "b (mode=full " in message and "protect_first=4 protect_last=64" in message
    checked = Handshake("full", CodecConfig(), LAYOUT, checksums=True)
    message = HANDSHAKE.mismatch(checked, this="this prefill server", other="decode d:1")
    assert message is not None
    assert "this prefill server (mode=full " in message and "checksums=off" in message
    assert "decode d:1 (mode=full " in message and "checksums=on" in message


def test_mismatched_keys_are_named_without_the_key() -> None:
    keyed = HANDSHAKE.signed_with(KEY)
    assert keyed.key_id == KEY.key_id != NO_KEY and HANDSHAKE.signed_with(None) == HANDSHAKE
    assert keyed.mismatch(HANDSHAKE, this="this prefill server", other="decode d:1") == (
        "this prefill server signs its Lynx messages (--lynx-auth-key-file), decode d:1 does not: "
        "give both servers the same key file, or neither"
    )
    assert HANDSHAKE.mismatch(keyed, this="this prefill server", other="decode d:1") == (
        "decode d:1 signs its Lynx messages (--lynx-auth-key-file), this prefill server does not: "
        "give both servers the same key file, or neither"
    )
    other = AuthKey(b"another key of 16+ bytes")
    message = keyed.mismatch(HANDSHAKE.signed_with(other), this="a", other="b")
    assert message == (
        "a and b sign their Lynx messages with different keys (--lynx-auth-key-file; key ids "
        f"{KEY.key_id.hex()} and {other.key_id.hex()}): give both servers the same key file"
    )
    assert Handshake.key_id_of(keyed.to_wire()) == KEY.key_id
    assert "0123456789abcdef" not in repr(KEY) and KEY.key_id.hex() in repr(KEY)


@pytest.mark.parametrize(("first", "last"), [(-1, 0), (0, -1), (1 << 32, 0)])
def test_protected_counts_must_fit_the_wire(first: int, last: int) -> None:
    with pytest.raises(ValueError, match="protected token counts"):
        Handshake("full", CodecConfig(), LAYOUT, protect_first=first, protect_last=last)


def test_describe_lists_every_setting() -> None:
    assert ODD.describe() == (
        "mode=anchor-only anchor_bits=3 group_size=16 residual=int8 key_layout=per_token "
        "key_block=32 protect_first=4 protect_last=300 checksums=on signed=key 0102030405060708 "
        "kv=[28 layers x 4 heads x 128, float16]"
    )


# ---- offer -------------------------------------------------------------------------------------


def test_offer_wire_bytes_are_pinned_and_round_trip() -> None:
    offer = Offer(HANDSHAKE.to_wire(), NONCE, 0x1000, 4096, 0x2000, 8192, 300)
    wire = offer.to_wire()
    assert wire.hex() == (
        "2d00"  # handshake length 45
        + HANDSHAKE.to_wire().hex()
        + NONCE_LE
        + "0010000000000000"  # anchor address
        + "0010000000000000"  # anchor bytes
        + "0020000000000000"  # residual address
        + "0020000000000000"  # residual bytes
        + "2c01000000000000"  # tokens
    )
    assert Offer.from_wire(wire) == offer
    assert offer.spans() == [(0x1000, 4096), (0x2000, 8192)]
    anchor_only = Offer(b"hs", 1, 0x1000, 4096, 0, 0, 300)
    assert Offer.from_wire(anchor_only.to_wire()) == anchor_only
    assert anchor_only.spans() == [(0x1000, 4096)]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x05",
        struct.pack("<H", 40) + b"short",  # handshake length beyond the message
        Offer(b"hs", 9, 1, 2, 3, 4, 5).to_wire()[:-1],  # body truncated
        Offer(b"hs", 9, 1, 2, 3, 4, 5).to_wire() + b"\0",  # trailing byte
    ],
)
def test_malformed_offers_raise_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed Lynx offer"):
        Offer.from_wire(data)


def test_an_offer_of_another_version_is_named() -> None:
    """A v2 offer had no nonce (its body is 8 bytes shorter) and a 36-byte handshake."""
    codec_and_layout = CodecConfig().to_wire() + LAYOUT.to_wire()
    v2_handshake = b"LXHS" + bytes([2, 0]) + struct.pack("<II", 0, 0) + codec_and_layout
    v2_offer = struct.pack("<H", 36) + v2_handshake + struct.pack("<QQQQQ", 64, 128, 192, 256, 10)
    with pytest.raises(ProtocolError, match="peer speaks Lynx protocol v2, this server v7"):
        Offer.from_wire(v2_offer)
    # A v4 offer has the same body: its 37-byte handshake is named when it is parsed.
    v4_handshake = b"LXHS" + bytes([4, 0, 0]) + struct.pack("<II", 0, 0) + codec_and_layout
    v4_offer = struct.pack("<H", 37) + v4_handshake + struct.pack("<QQQQQQ", 1, 64, 128, 192, 256, 10)
    with pytest.raises(ProtocolError, match="peer speaks Lynx protocol v4, this server v7"):
        parse_handshake(Offer.from_wire(v4_offer).handshake)
    with pytest.raises(ProtocolError, match="peer speaks Lynx protocol v4, this server v7"):
        Handshake.key_id_of(v4_handshake)


def hmac_of(label: bytes, data: bytes) -> bytes:
    """What the protocol says a MAC is, computed here from its definition."""
    return hmac.digest(
        b"0123456789abcdef0123456789abcdef", bytes([len(label)]) + label + data, hashlib.sha256
    )


def test_a_signed_offer_carries_a_mac_over_where_it_sends_and_its_fields() -> None:
    offer = Offer(HANDSHAKE.signed_with(KEY).to_wire(), NONCE, 0x1000, 4096, 0x2000, 8192, 300)
    bound = OfferBinding(ROOM, "10.0.0.2:16001", ("10.0.0.2", 17000))
    signed = offer.signed(KEY, bound)
    unsigned = offer.to_wire()
    binding_wire = (  # <QHHH room, session and host lengths, port; then the two names
        bytes.fromhex(ROOM_LE)
        + (14).to_bytes(2, "little")
        + (8).to_bytes(2, "little")
        + (17000).to_bytes(2, "little")
        + b"10.0.0.2:16001"
        + b"10.0.0.2"
    )
    assert bound.to_bytes() == binding_wire
    assert signed.to_wire() == unsigned + hmac_of(b"OFFER", binding_wire + unsigned)
    assert Offer.from_wire(signed.to_wire()) == signed
    assert signed.verify(KEY, bound)
    assert not offer.verify(KEY, bound)  # unsigned
    # replayed for another room, to another Mooncake session, or naming another notice endpoint
    assert not signed.verify(KEY, dataclasses.replace(bound, room=ROOM + 1))
    assert not signed.verify(KEY, dataclasses.replace(bound, session="10.0.0.66:16001"))
    assert not signed.verify(KEY, dataclasses.replace(bound, endpoint=("10.0.0.66", 17000)))
    assert not signed.verify(KEY, dataclasses.replace(bound, endpoint=("10.0.0.2", 17001)))
    assert not signed.verify(AuthKey(b"another key of 16+ bytes"), bound)
    moved = dataclasses.replace(signed, anchor_addr=0x3000)  # any field changed on the way
    assert not Offer.from_wire(moved.to_wire()).verify(KEY, bound)
    with pytest.raises(ProtocolError, match="malformed Lynx offer"):
        Offer.from_wire(signed.to_wire()[:-1])  # a MAC is 32 bytes or absent
    # a binding no message can carry verifies nothing (and raises nothing)
    assert not signed.verify(KEY, dataclasses.replace(bound, room=1 << 64))
    assert not signed.verify(KEY, dataclasses.replace(bound, session="s\u00e9ssion"))


@pytest.mark.parametrize("room", [-1, 1 << 64, 1 << 70, True, 1.0])
def test_a_room_outside_u64_is_refused_naming_it(room: object) -> None:
    with pytest.raises(RoomError, match=r"is not an integer in 0\.\.2\*\*64-1"):
        check_room(room)  # type: ignore[arg-type]
    assert check_room(0) == 0 and check_room((1 << 64) - 1) == (1 << 64) - 1


def test_an_offer_with_a_handshake_over_the_limit_is_refused_before_it_is_read() -> None:
    long = Offer(b"x" * (HANDSHAKE_MAX_NBYTES + 1), NONCE, 64, 128, 192, 256, 10)
    with pytest.raises(ProtocolError, match=f"handshake is {HANDSHAKE_MAX_NBYTES + 1} bytes, at most"):
        Offer.from_wire(long.to_wire())


def test_append_and_split_offer() -> None:
    offer = Offer(HANDSHAKE.to_wire(), NONCE, 64, 128, 192, 256, 10)
    upstream = [b"42", b"10.0.0.1", b"7000", b"session"]
    frames = append_offer(upstream, offer)
    assert frames == [*upstream, b"LYNX1", offer.to_wire()]
    assert upstream == [b"42", b"10.0.0.1", b"7000", b"session"]  # not mutated
    assert split_offer(frames) == (upstream, offer.to_wire())
    assert split_offer(upstream) == (upstream, None)
    assert split_offer([]) == ([], None)
    assert split_offer([b"LYNX1"]) == ([b"LYNX1"], None)


# ---- notices -----------------------------------------------------------------------------------


RESERVATION_LE = ROOM_LE + NONCE_LE
NOTICES: list[tuple[Notice, str]] = [
    (
        Notice(NoticeKind.ACCEPT, ROOM, NONCE, handshake=HANDSHAKE.to_wire()),
        RESERVATION_LE + HANDSHAKE.to_wire().hex(),
    ),
    (Notice(NoticeKind.REJECT, ROOM, NONCE, text="nö"), RESERVATION_LE + "6ec3b6"),
    (
        Notice(NoticeKind.LANDED, ROOM, NONCE, stream=Stream.RESIDUAL, ok=False, nbytes=1234, text="boom"),
        RESERVATION_LE + "01" + "00" + "d204000000000000" + "00000000" + b"boom".hex(),
    ),
    (
        Notice(
            NoticeKind.LANDED,
            ROOM,
            NONCE,
            stream=Stream.ANCHOR,
            ok=True,
            nbytes=0x0A0B0C,
            checksums=(0x01020304, 0xFFFFFFFF),
        ),
        RESERVATION_LE + "00" + "01" + "0c0b0a0000000000" + "02000000" + "04030201" + "ffffffff",
    ),
    (Notice(NoticeKind.RELEASED, ROOM, NONCE), RESERVATION_LE),
    (
        Notice(NoticeKind.LAYERS, ROOM, NONCE, layers=0x0102, first_layer=3, checksums=(0x01020304, 7)),
        RESERVATION_LE + "0300" + "0201" + "02000000" + "04030201" + "07000000",
    ),
    (Notice(NoticeKind.LAYERS, ROOM, NONCE, layers=1), RESERVATION_LE + "0000" + "0100" + "00000000"),
]


@pytest.mark.parametrize(("notice", "payload_hex"), NOTICES)
def test_notice_frames_are_pinned_and_round_trip(notice: Notice, payload_hex: str) -> None:
    frames = notice.to_frames()
    assert frames == [b"LYNX1", notice.kind.value, bytes.fromhex(payload_hex)]
    assert is_notice(frames)
    assert Notice.from_frames(frames) == notice


@pytest.mark.parametrize(("notice", "payload_hex"), NOTICES)
def test_a_signed_notice_carries_a_mac_over_its_kind_and_payload(notice: Notice, payload_hex: str) -> None:
    payload = bytes.fromhex(payload_hex)
    frames = notice.to_frames(KEY)
    assert frames == [b"LYNX1", notice.kind.value, payload, hmac_of(notice.kind.value, payload)]
    assert Notice.from_frames(frames) == notice
    assert Notice.head_of(frames) == (notice.kind, ROOM, NONCE)
    assert unsigned_reason(frames, KEY) is None
    assert unsigned_reason(notice.to_frames(), KEY) == "unsigned"
    assert unsigned_reason(notice.to_frames(AuthKey(b"another key of 16+ bytes")), KEY) == "bad_signature"
    tampered = [*frames[:2], payload[:-1] + bytes([payload[-1] ^ 1]), frames[3]]
    assert unsigned_reason(tampered, KEY) == "bad_signature"
    relabelled = [
        frames[0],
        b"RELEASED" if notice.kind is not NoticeKind.RELEASED else b"REJECT",
        *frames[2:],
    ]
    assert unsigned_reason(relabelled, KEY) == "bad_signature"


def test_notice_kind_names_are_pinned() -> None:
    assert {k.name: k.value for k in NoticeKind} == {
        "ACCEPT": b"ACCEPT",
        "REJECT": b"REJECT",
        "LANDED": b"LANDED",
        "RELEASED": b"RELEASED",
        "LAYERS": b"LAYERS",
    }
    assert (int(Stream.ANCHOR), int(Stream.RESIDUAL)) == (0, 1)


def test_is_notice() -> None:
    assert not is_notice([])
    assert not is_notice([b"42", b"LYNX1"])


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([], "not a Lynx notice"),
        ([b"LYNX1", b"RELEASED"], "not a Lynx notice"),
        ([b"LYNX2", b"RELEASED", bytes(8)], "not a Lynx notice"),
        ([b"LYNX1", b"RELEASED", bytes(16), b""], "MAC is 32 bytes, got 0"),
        ([b"LYNX1", b"RELEASED", bytes(16), bytes(32), b""], "not a Lynx notice"),
        ([b"LYNX1", b"HELLO", bytes(8)], "unknown Lynx notice"),
        ([b"LYNX1", b"RELEASED", bytes(15)], "malformed Lynx RELEASED"),  # a v2 RELEASED: no nonce
        ([b"LYNX1", b"ACCEPT", bytes(8)], "malformed Lynx ACCEPT"),
        ([b"LYNX1", b"REJECT", bytes(11)], "malformed Lynx REJECT"),
        ([b"LYNX1", b"LANDED", bytes(29)], "malformed Lynx LANDED"),
        ([b"LYNX1", b"LAYERS", bytes(23)], "malformed Lynx LAYERS"),
        ([b"LYNX1", b"LAYERS", bytes(25)], "malformed Lynx LAYERS"),  # a byte after its checksums
        ([b"LYNX1", b"LAYERS", struct.pack("<QQHHI", 1, 2, 0, 1, 2) + bytes(4)], "malformed Lynx LAYERS"),
        (
            [b"LYNX1", b"LANDED", struct.pack("<QQBBQI", 1, 2, 2, 1, 0, 0)],
            "malformed Lynx LANDED",
        ),  # stream 2
        ([b"LYNX1", b"LANDED", struct.pack("<QQBBQI", 1, 2, 0, 0, 0, 0) + b"\xff"], "malformed Lynx LANDED"),
        # more checksums announced than the payload holds
        ([b"LYNX1", b"LANDED", struct.pack("<QQBBQII", 1, 2, 0, 1, 64, 2, 7)], "malformed Lynx LANDED"),
        ([b"LYNX1", b"LANDED", struct.pack("<QQBBQI", 1, 2, 0, 1, 64, 1 << 30)], "malformed Lynx LANDED"),
    ],
)
def test_malformed_notices_raise_protocol_error(frames: list[bytes], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        Notice.from_frames(frames)


# ---- request layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("config", [CodecConfig(), CodecConfig(anchor_bits=2, residual="exact")])
@pytest.mark.parametrize("n_tokens", [1, 255, 256, 257, 600, 768])
def test_request_layout_segments(config: CodecConfig, n_tokens: int) -> None:
    plan = RequestLayout(LAYOUT, config, n_tokens, Mode.FULL)
    assert plan.n_tokens == n_tokens
    segments = plan.segments
    assert len(segments) == -(-n_tokens // SEGMENT_TOKENS)
    assert [s.start for s in segments] == list(range(0, n_tokens, SEGMENT_TOKENS))
    assert all(s.end - s.start == SEGMENT_TOKENS for s in segments[:-1])
    assert segments[-1].end == n_tokens
    assert 0 < segments[-1].end - segments[-1].start <= SEGMENT_TOKENS
    anchor_at = residual_at = 0
    for s in segments:
        assert (s.anchor_nbytes, s.residual_nbytes) == segment_nbytes(LAYOUT, s.end - s.start, config)
        assert (s.anchor_offset, s.residual_offset) == (anchor_at, residual_at)  # back to back
        assert not s.protected
        anchor_at += s.anchor_nbytes
        residual_at += s.residual_nbytes
    assert (plan.anchor_nbytes, plan.residual_nbytes) == (anchor_at, residual_at)
    assert (plan.protect_until, plan.protect_from, plan.protected_tokens) == (0, n_tokens, 0)
    assert plan.streams == (Stream.ANCHOR, Stream.RESIDUAL)
    protected = RequestLayout.of(Handshake("full", config, LAYOUT, protect_first=0, protect_last=0), n_tokens)
    assert protected.segments == plan.segments  # no protection: the v1 layout, byte for byte


def check_protected_layout(plan: RequestLayout, layout: KVLayout, config: CodecConfig) -> None:
    """Segments tile the request; each one's Anchor, then (protected) its Residual, sit back
    to back in the Anchor region, unprotected Residuals back to back in the Residual region."""
    anchor_at = residual_at = 0
    assert plan.segments[0].start == 0 and plan.segments[-1].end == plan.n_tokens
    for s, after in itertools.pairwise([*plan.segments, None]):
        assert 0 < s.end - s.start <= SEGMENT_TOKENS
        assert after is None or after.start == s.end
        assert s.protected == (s.end <= plan.protect_until or s.start >= plan.protect_from)
        assert (s.anchor_nbytes, s.residual_nbytes) == segment_nbytes(layout, s.end - s.start, config)
        assert s.anchor_offset == anchor_at
        anchor_at += s.anchor_nbytes
        anchor, residual = plan.byte_ranges(s)
        assert anchor == slice(s.anchor_offset, anchor_at)
        if s.protected:
            assert (s.residual_stream, s.residual_offset) == (Stream.ANCHOR, anchor_at)
            assert residual == slice(anchor_at, anchor_at + s.residual_nbytes)
            anchor_at += s.residual_nbytes
        else:
            assert (s.residual_stream, s.residual_offset) == (Stream.RESIDUAL, residual_at)
            start = plan.anchor_nbytes + residual_at
            assert residual == slice(start, start + s.residual_nbytes)
            residual_at += s.residual_nbytes
    assert (plan.anchor_nbytes, plan.residual_nbytes) == (anchor_at, residual_at)
    assert plan.encoded_nbytes == sum(
        sum(segment_nbytes(layout, s.end - s.start, config)) for s in plan.segments
    )


@pytest.mark.parametrize(
    ("n_tokens", "first", "last", "config", "cuts", "protected"),
    [
        # first rounded up to 16, last 40 -> tail from 560 (a multiple of 16 already)
        (600, 5, 40, CodecConfig(), [0, 16, 256, 512, 560], [1, 0, 0, 0, 1]),
        (600, 300, 0, CodecConfig(), [0, 256, 304, 512], [1, 1, 0, 0]),  # 300 -> 304
        (600, 0, 100, CodecConfig(key_block=64), [0, 256, 448, 512], [0, 0, 1, 1]),  # 500 -> 448
        (600, 256, 88, CodecConfig(), [0, 256, 512], [1, 0, 1]),  # on segment bounds: no new cut
        (600, 5, 3, CodecConfig(key_layout="per_token"), [0, 5, 256, 512, 597], [1, 0, 0, 0, 1]),
        (600, 300, 300, CodecConfig(), [0, 256, 512], [1, 1, 1]),  # the ranges overlap: all
        (600, 0, 600, CodecConfig(), [0, 256, 512], [1, 1, 1]),
        (600, 1 << 16, 0, CodecConfig(), [0, 256, 512], [1, 1, 1]),
        (20, 1, 1, CodecConfig(), [0], [1]),  # [0, 16) and [16, 20) meet
        (40, 1, 1, CodecConfig(), [0, 16, 32], [1, 0, 1]),  # 39 -> 32
        (1, 1, 0, CodecConfig(), [0], [1]),
    ],
)
@pytest.mark.parametrize("mode", list(Mode))
def test_request_layout_with_protected_tokens(
    n_tokens: int,
    first: int,
    last: int,
    config: CodecConfig,
    cuts: list[int],
    protected: list[int],
    mode: Mode,
) -> None:
    handshake = Handshake(mode, config, LAYOUT, protect_first=first, protect_last=last)
    plan = RequestLayout.of(handshake, n_tokens)
    assert [s.start for s in plan.segments] == cuts
    assert [int(s.protected) for s in plan.segments] == protected
    check_protected_layout(plan, LAYOUT, config)
    if all(protected):
        assert (plan.protect_until, plan.protect_from) == (n_tokens, n_tokens)
        assert plan.protects_all and plan.protected_tokens == n_tokens
        assert plan.residual_nbytes == 0  # an empty Residual region travels as no stream
        assert plan.streams == (Stream.ANCHOR,) and plan.receive_nbytes == plan.anchor_nbytes
    else:
        assert plan.streams == RequestLayout(LAYOUT, config, n_tokens, mode).streams
    assert plan.sent_residual_nbytes == (plan.residual_nbytes if Stream.RESIDUAL in plan.streams else 0)
    # what travels: each byte of the request's space on exactly one stream, or not at all
    sent = {stream: 0 for stream in Stream}
    for seg in plan.segments:
        for stream, span in plan.sent_ranges(seg):
            assert stream in plan.streams
            region = plan.region_offset(stream)
            assert (
                region
                <= span.start
                < span.stop
                <= region + (plan.anchor_nbytes, plan.residual_nbytes)[stream]
            )
            sent[stream] += span.stop - span.start
        streams = [stream for stream, _ in plan.sent_ranges(seg)]
        assert len(streams) == len(set(streams))  # one contiguous range per stream
        if seg.protected:  # its Residual follows its Anchor: one range, on the Anchor stream
            anchor, residual = plan.byte_ranges(seg)
            assert plan.sent_ranges(seg) == [(Stream.ANCHOR, slice(anchor.start, residual.stop))]
    assert (sent[Stream.ANCHOR], sent[Stream.RESIDUAL]) == (plan.anchor_nbytes, plan.sent_residual_nbytes)
    assert sent == plan.sent_nbytes() == RequestLayout.sent_nbytes_of(handshake, n_tokens)
    for stream in Stream:  # what the checksums of a stream cover, segment by segment
        ranges = plan.stream_ranges(stream)
        assert [span for _, span in ranges] == [
            span for seg in plan.segments for s, span in plan.sent_ranges(seg) if s is stream
        ]
        assert sum(span.stop - span.start for _, span in ranges) == sent[stream]


@settings(max_examples=200, deadline=None)
@given(
    n_tokens=st.integers(1, 2000),
    first=st.integers(0, 2100),
    last=st.integers(0, 2100),
    key_block=st.sampled_from([2, 16, 32, 256]),
)
def test_protected_bounds_fall_on_key_blocks(n_tokens: int, first: int, last: int, key_block: int) -> None:
    config = CodecConfig(key_block=key_block)
    plan = RequestLayout(LAYOUT, config, n_tokens, Mode.FULL, protect_first=first, protect_last=last)
    check_protected_layout(plan, LAYOUT, config)
    # every cut on the key-block grid of the request (SEGMENT_TOKENS is on it too)
    assert all(s.start % key_block == 0 for s in plan.segments)
    wanted = {*range(min(first, n_tokens)), *range(max(0, n_tokens - last), n_tokens)}
    got = {t for s in plan.segments if s.protected for t in range(s.start, s.end)}
    assert wanted <= got and len(got) == plan.protected_tokens
    if not plan.protects_all:  # rounded outwards by less than a key block on each side
        assert plan.protect_until - first < key_block and (n_tokens - last) - plan.protect_from < key_block
        assert got == {*range(plan.protect_until), *range(plan.protect_from, n_tokens)}


@pytest.mark.parametrize("mode", list(Mode))
def test_protection_cost(mode: Mode) -> None:
    config = CodecConfig()
    assert protection_cost(Handshake(mode, config, LAYOUT), 600) == (0, 0)
    # [0, 16) and [560, 600): their Residual moves onto the Anchor stream
    handshake = Handshake(mode, config, LAYOUT, protect_first=5, protect_last=40)
    moved = segment_nbytes(LAYOUT, 16, config)[1] + segment_nbytes(LAYOUT, 40, config)[1]
    anchor_extra = sum(segment_nbytes(LAYOUT, n, config)[0] for n in (16, 240, 48, 40)) - sum(
        segment_nbytes(LAYOUT, n, config)[0] for n in (256, 88)
    )  # the codec padding of the two extra cuts
    residual_extra = sum(segment_nbytes(LAYOUT, n, config)[1] for n in (16, 240, 48, 40)) - sum(
        segment_nbytes(LAYOUT, n, config)[1] for n in (256, 88)
    )
    assert protection_cost(handshake, 600) == (
        moved + anchor_extra,
        anchor_extra + (residual_extra if mode.sends_residual else moved),
    )


@settings(max_examples=300, deadline=None)
@given(
    n_tokens=st.integers(1, 3000),
    first=st.integers(0, 3100),
    last=st.integers(0, 3100),
    key_block=st.sampled_from([2, 16, 256]),
    mode=st.sampled_from(list(Mode)),
    residual=st.sampled_from(["int8", "exact"]),
)
def test_sent_nbytes_by_arithmetic_match_the_layout(
    n_tokens: int, first: int, last: int, key_block: int, mode: Mode, residual: str
) -> None:
    config = CodecConfig(key_block=key_block, residual=residual)  # type: ignore[arg-type]
    handshake = Handshake(mode, config, LAYOUT, protect_first=first, protect_last=last)
    plan = RequestLayout.of(handshake, n_tokens)
    assert RequestLayout.sent_nbytes_of(handshake, n_tokens) == plan.sent_nbytes()
    assert plan.sent_nbytes() == {
        Stream.ANCHOR: plan.anchor_nbytes,
        Stream.RESIDUAL: plan.sent_residual_nbytes,
    }


def test_sent_nbytes_of_an_absurd_token_count_builds_nothing() -> None:
    """A peer's count is checked by arithmetic: 2**50 tokens cost a few calls, not a layout."""
    started = time.monotonic()
    sizes = RequestLayout.sent_nbytes_of(HANDSHAKE, 1 << 50)
    assert time.monotonic() - started < 0.5
    anchor, residual = segment_nbytes(LAYOUT, SEGMENT_TOKENS, HANDSHAKE.codec)
    whole = (1 << 50) // SEGMENT_TOKENS
    assert sizes == {Stream.ANCHOR: whole * anchor, Stream.RESIDUAL: whole * residual}
    with pytest.raises(ValueError, match="at least one token"):
        RequestLayout.sent_nbytes_of(HANDSHAKE, 0)


def test_request_layout_needs_a_token() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        RequestLayout(LAYOUT, CodecConfig(), 0, Mode.FULL)


def test_ready_returns_whole_segments_only_unless_last() -> None:
    plan = RequestLayout(LAYOUT, CodecConfig(), 600, Mode.FULL)
    first, second, third = plan.segments
    assert plan.ready(0, last=False) == []
    assert plan.ready(255, last=False) == []
    assert plan.ready(256, last=False) == [first]
    assert plan.ready(599, last=False) == [first, second]
    assert plan.ready(600, last=False) == [first, second, third]
    assert plan.ready(10, last=True) == [first, second, third]


def test_bytes_per_token_is_that_of_a_full_segment() -> None:
    anchor, residual = segment_nbytes(LAYOUT, SEGMENT_TOKENS, CodecConfig())
    assert bytes_per_token(LAYOUT, CodecConfig()) == (anchor / SEGMENT_TOKENS, residual / SEGMENT_TOKENS)


# ---- checksums ------------------------------------------------------------------------------


def reference_checksum(data: bytes) -> int:
    """The module docstring's definition, word by word (the last zero-padded)."""
    data += bytes(-len(data) % 4)
    words = struct.unpack(f"<{len(data) // 4}I", data)
    return sum((2 * (i // CHECKSUM_BLOCK_WORDS) + 1) * w for i, w in enumerate(words)) % (1 << 32)


def checksum_of(span: torch.Tensor) -> int:
    (value,) = checksum_values([span_checksum(span)])
    return value


def test_span_checksum_is_pinned() -> None:
    data = bytes(range(256)) * 40  # 2560 words: two whole 4 KiB blocks and a partial one
    span = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert checksum_of(span) == reference_checksum(data) == 0x0CF2CC00
    gen = torch.Generator().manual_seed(7)
    for nbytes in (16, 4096, 4112, 3 * 4096 + 48, 40000):
        noise = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        assert checksum_of(noise) == reference_checksum(noise.numpy().tobytes())
    # a range inside a larger buffer (as in the send and receive buffers)
    assert checksum_of(torch.cat([torch.zeros(64, dtype=torch.uint8), span])[64:]) == 0x0CF2CC00
    assert checksum_of(torch.zeros(0, dtype=torch.uint8)) == 0
    assert checksum_values([]) == []
    # any range: one that does not start on a word, or ends inside one (a layer's bytes)
    for start, end in ((1, 4096), (3, 4103), (0, 18), (2, 3)):
        noise = torch.randint(0, 256, (end + 8,), dtype=torch.uint8, generator=gen)
        assert checksum_of(noise[start:end]) == reference_checksum(noise[start:end].numpy().tobytes())


def test_span_checksum_catches_changed_words_moved_blocks_and_stale_bytes() -> None:
    gen = torch.Generator().manual_seed(3)
    span = torch.randint(0, 256, (3 * 4096 + 48,), dtype=torch.uint8, generator=gen)
    base = checksum_of(span)
    for at in (0, 1, 4095, 4096, 8191, 3 * 4096 + 47):  # every block, and the partial one
        for delta in (1, 2, 128, 255):
            changed = span.clone()
            changed[at] = (int(changed[at]) + delta) % 256
            assert checksum_of(changed) != base, (at, delta)
    words = span.view(torch.int32).clone()
    words[5] = words[5] ^ -1  # a word's every bit
    assert checksum_of(words.view(torch.uint8)) != base
    swapped = span.clone()
    swapped[:4096], swapped[8192:12288] = span[8192:12288], span[:4096]  # blocks 0 and 2
    assert checksum_of(swapped) != base
    assert checksum_of(torch.zeros_like(span)) != base  # bytes never written
    other = torch.randint(0, 256, span.shape, dtype=torch.uint8, generator=gen)
    assert checksum_of(other) != base  # another request's bytes


# ---- chunking does not change what decode gets ---------------------------------------------------

ROWS = 1024
SMALL = KVLayout(2, 2, 32, torch.bfloat16)


@pytest.fixture
def one_codec_thread() -> Iterator[None]:
    """The CPU codec runs on torch's thread count; on this little data, and a busy 2-core
    host, a team of threads mostly waits on its barriers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pool(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (ROWS, SMALL.num_kv_heads, SMALL.head_dim)
    k = [torch.randn(shape, generator=gen).to(SMALL.dtype) for _ in range(SMALL.num_layers)]
    v = [torch.randn(shape, generator=gen).to(SMALL.dtype) for _ in range(SMALL.num_layers)]
    return k, v


def _encode_in_chunks(
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    plan: RequestLayout,
    chunks: list[int],
) -> torch.Tensor:
    """What the sender does: encode each segment once the chunks received so far cover it.
    Returns the request's space (Anchor region, then Residual region)."""
    space = torch.zeros(plan.encoded_nbytes, dtype=torch.uint8)
    tokens = sent = 0
    for i, size in enumerate(chunks):
        tokens += size
        ready = plan.ready(tokens, last=i == len(chunks) - 1)[sent:]
        for seg in ready:
            anchor, residual = plan.byte_ranges(seg)
            encode_pages(k, v, slots[seg.start : seg.end], config, space[anchor], space[residual])
        sent += len(ready)
    assert sent == len(plan.segments)
    return space


def _decode_request(
    space: torch.Tensor, config: CodecConfig, plan: RequestLayout, *, residual: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What the receiver does: protected segments at full precision, the rest with
    the Residual only if ``residual``."""
    k, v = _pool(seed=99)
    dst = torch.arange(plan.n_tokens, dtype=torch.int64)
    for seg in plan.segments:
        anchor, residual_bytes = plan.byte_ranges(seg)
        full = residual or seg.protected
        decode_pages(
            space[anchor], space[residual_bytes] if full else None, k, v, dst[seg.start : seg.end], config
        )
    return [t[: plan.n_tokens] for t in k], [t[: plan.n_tokens] for t in v]


@st.composite
def chunkings(draw: st.DrawFn) -> tuple[int, list[int], int, tuple[int, int], int]:
    n_tokens = draw(st.integers(1, 700))
    cuts = sorted(draw(st.sets(st.integers(1, n_tokens - 1), max_size=6))) if n_tokens > 1 else []
    bounds = [0, *cuts, n_tokens]
    key_block = draw(st.sampled_from([2, 4, 16, 64, 256]))
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    protect = draw(st.sampled_from([(0, 0), (1, 0), (0, 70), (20, 300), (400, 400)]))
    return n_tokens, sizes, key_block, protect, draw(st.integers(0, 99))


@settings(max_examples=16, deadline=None)
@given(chunkings())
@pytest.mark.usefixtures("one_codec_thread")
def test_decoded_kv_does_not_depend_on_how_prefill_chunked(
    case: tuple[int, list[int], int, tuple[int, int], int],
) -> None:
    n_tokens, chunks, key_block, (first, last), seed = case
    config = CodecConfig(key_layout="per_channel", key_block=key_block, group_size=16)
    assert SEGMENT_TOKENS % key_block == 0
    plan = RequestLayout(SMALL, config, n_tokens, Mode.FULL, protect_first=first, protect_last=last)
    plain = RequestLayout(SMALL, config, n_tokens, Mode.FULL)
    k, v = _pool(seed)
    slots = torch.randperm(ROWS, generator=torch.Generator().manual_seed(seed))[:n_tokens]
    one_shot = _encode_in_chunks(k, v, slots, config, plan, [n_tokens])
    chunked = _encode_in_chunks(k, v, slots, config, plan, chunks)
    assert torch.equal(chunked, one_shot)
    plain_space = _encode_in_chunks(k, v, slots, config, plain, [n_tokens])
    unprotected = torch.tensor([plan.protect_until <= t < plan.protect_from for t in range(n_tokens)])
    for residual in (False, True):
        got_k, got_v = _decode_request(chunked, config, plan, residual=residual)
        # The codec's tensor API on each segment's gathered rows is the reference.
        for seg in plan.segments:
            rows = slots[seg.start : seg.end]
            for kind, pool, got in (("key", k, got_k), ("value", v, got_v)):
                for layer in range(SMALL.num_layers):
                    part = pool[layer][rows]
                    enc = encode(part, config, kind=kind)
                    expect = decode(
                        enc.anchor,
                        enc.residual if residual or seg.protected else None,
                        config=config,
                        shape=part.shape,
                        dtype=part.dtype,
                        kind=kind,
                    )
                    assert torch.equal(got[layer][seg.start : seg.end], expect)
        # Protection cuts on key blocks: an unprotected token decodes as with no protection.
        plain_k, plain_v = _decode_request(plain_space, config, plain, residual=residual)
        for got, want in ((got_k, plain_k), (got_v, plain_v)):
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g[unprotected], w[unprotected])


def test_mismatch_of_heads_per_rank_names_the_tp_size() -> None:
    split = Handshake("full", CodecConfig(), KVLayout(LAYOUT.num_layers, 1, LAYOUT.head_dim, LAYOUT.dtype))
    message = HANDSHAKE.mismatch(split, this="this prefill server", other="decode d:1")
    assert message is not None
    assert "x 2 heads x" in message and "x 1 heads x" in message
    assert "--tp-size" in message and "--lynx-*" not in message
    # heads and anything else differing: the general hint
    other = Handshake("full", CodecConfig(anchor_bits=2), split.layout)
    message = HANDSHAKE.mismatch(other, this="a", other="b")
    assert message is not None and "--lynx-*" in message and "--tp-size" not in message


def test_notice_text_is_cut_to_what_a_receiver_reads() -> None:
    """Whole UTF-8 characters, at most NOTICE_TEXT_MAX bytes: a receiver bounds what it
    reads of a notice by that."""
    frames = Notice(NoticeKind.REJECT, 1, 2, text="é" * NOTICE_TEXT_MAX + "!").to_frames()
    assert len(frames[2]) == 16 + NOTICE_TEXT_MAX
    assert Notice.from_frames(frames).text == "é" * (NOTICE_TEXT_MAX // 2)
    assert Notice.head_of(frames) == (NoticeKind.REJECT, 1, 2)
