"""Pins the codec's wire format: handshake bytes, settings validation, segment sizes and
the exact bytes of tiny encoded inputs."""

import hashlib
import struct

import pytest
import torch

from lynx.codec import (
    WIRE_VERSION,
    CodecConfig,
    CodecInputError,
    KVLayout,
    WireMismatchError,
    decode,
    encode,
    lossless,
    segment_nbytes,
)
from lynx.codec.reference import pack_codes, unpack_codes


def test_config_handshake_bytes_are_pinned() -> None:
    assert WIRE_VERSION == 3
    assert CodecConfig().to_wire().hex() == "4c58430304200001001000"  # the lossless residual
    assert CodecConfig(residual="int8").to_wire().hex() == "4c58430304200000001000"
    wire = CodecConfig(
        anchor_bits=2, group_size=64, residual="exact", key_layout="per_token", key_block=32
    ).to_wire()
    assert wire.hex() == "4c58430302400001012000"


def test_an_older_peer_is_refused_by_its_version() -> None:
    older = bytearray(CodecConfig().to_wire())
    for version in (1, 2):  # 1: the exact residual was the raw words; 2: its bodies had no block table
        older[3] = version
        with pytest.raises(WireMismatchError, match=f"peer speaks codec wire version {version}, this side 3"):
            CodecConfig.from_wire(bytes(older))


def test_layout_handshake_bytes_are_pinned() -> None:
    layout = KVLayout(30, 3, 64, torch.bfloat16)
    assert layout.to_wire().hex() == "4c584c031e000300400000"
    assert KVLayout.from_wire(layout.to_wire()) == layout
    assert KVLayout.from_wire(KVLayout(2, 8, 128, torch.float16).to_wire()).dtype == torch.float16


@pytest.mark.parametrize(
    "config",
    [
        CodecConfig(),
        CodecConfig(anchor_bits=3, group_size=16, residual="exact", key_block=8),
        CodecConfig(anchor_bits=2, group_size=256, key_layout="per_token", key_block=256),
    ],
)
def test_config_round_trips_and_peers_compare(config: CodecConfig) -> None:
    assert CodecConfig.from_wire(config.to_wire()) == config
    config.check_peer(config.to_wire())
    other = CodecConfig(anchor_bits=2 if config.anchor_bits != 2 else 4)
    with pytest.raises(WireMismatchError, match="differ"):
        config.check_peer(other.to_wire())


def test_foreign_or_future_handshakes_are_refused() -> None:
    wire = bytearray(CodecConfig().to_wire())
    with pytest.raises(WireMismatchError, match="10"):
        CodecConfig.from_wire(bytes(wire[:-1]))
    future = bytearray(wire)
    future[3] = WIRE_VERSION + 1
    with pytest.raises(WireMismatchError, match="version"):
        CodecConfig.from_wire(bytes(future))
    bad_magic = b"XXX" + bytes(wire[3:])
    with pytest.raises(WireMismatchError, match="magic"):
        CodecConfig.from_wire(bad_magic)
    bad_bits = bytearray(wire)
    bad_bits[4] = 7
    with pytest.raises(WireMismatchError, match="anchor_bits"):
        CodecConfig.from_wire(bytes(bad_bits))
    bad_mode = bytearray(wire)
    bad_mode[7] = 9
    with pytest.raises(WireMismatchError, match="residual"):
        CodecConfig.from_wire(bytes(bad_mode))
    layout = bytearray(KVLayout(1, 1, 8, torch.float32).to_wire())
    layout[3] = 0
    with pytest.raises(WireMismatchError, match="version"):
        KVLayout.from_wire(bytes(layout))
    with pytest.raises(WireMismatchError, match="differs"):
        KVLayout(1, 1, 8, torch.float32).check_peer(KVLayout(1, 1, 8, torch.float16).to_wire())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"anchor_bits": 1},
        {"anchor_bits": 5},
        {"group_size": 4},
        {"group_size": 24},
        {"group_size": 512},
        {"residual": "int4"},
        {"key_layout": "hadamard"},
        {"key_block": 1},
        {"key_block": 12},
    ],
)
def test_invalid_settings_raise(kwargs: dict) -> None:
    with pytest.raises(CodecInputError):
        CodecConfig(**kwargs)


def test_invalid_layouts_raise() -> None:
    with pytest.raises(CodecInputError, match="head_dim"):
        KVLayout(2, 2, 12, torch.bfloat16)
    with pytest.raises(CodecInputError, match="dtype"):
        KVLayout(2, 2, 16, torch.int8)
    with pytest.raises(CodecInputError, match="num_layers"):
        KVLayout(0, 2, 16, torch.bfloat16)
    with pytest.raises(CodecInputError, match="does not divide head_dim"):
        segment_nbytes(KVLayout(2, 2, 16, torch.bfloat16), 4, CodecConfig(group_size=32))


def test_segment_sizes() -> None:
    layout = KVLayout(30, 3, 64, torch.bfloat16)
    # 2048 tokens: keys 128 blocks x 192 channels, values 2048 x 6 groups; bf16 params.
    key_anchor = 2 * 128 * 192 * 2 + 2048 * 192 // 2
    value_anchor = 2 * 2048 * 6 * 2 + 2048 * 192 // 2
    anchor = 30 * (key_anchor + value_anchor)
    assert segment_nbytes(layout, 2048, CodecConfig(residual="int8")) == (anchor, 30 * 2 * 2048 * 192 // 2)
    # The lossless residual's capacity: its head (length, 60 part ends), then per part a
    # format byte and the raw words, padded to 16 bytes.
    head = 4 * (1 + 60)
    assert segment_nbytes(layout, 2048, CodecConfig()) == (
        anchor,
        -(-(head + 60 * (1 + 2048 * 192 * 2)) // 16) * 16,
    )
    # 17 tokens: a partial key block; every array padded to 16 bytes.
    anchor, residual = segment_nbytes(layout, 17, CodecConfig(anchor_bits=3, residual="int8"))
    codes = 1232  # 17 * 192 * 3 / 8 = 1224, padded
    key = 2 * (2 * 192 * 2) + codes  # 2 blocks (16 + 1 tokens) x 192 channels
    value = 2 * 208 + codes  # 17 x 6 groups x 2 bytes = 204, padded
    assert (anchor, residual) == (30 * (key + value), 30 * 2 * 2048)  # 17 * 192 * 5 / 8 = 2040, padded
    assert segment_nbytes(layout, 0, CodecConfig()) == (0, 0)


def _hex(t: torch.Tensor) -> str:
    return t.numpy().tobytes().hex()


def test_value_bytes_are_pinned() -> None:
    config = CodecConfig(anchor_bits=4, group_size=8, residual="int8")
    x = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7.5], [-1] * 8], dtype=torch.bfloat16)
    enc = encode(x, config)
    pad = "00" * 12
    # mins (0, -1) | scales (0.5, 0: a constant group) | codes 0,2,4,..,15 then 0s
    assert _hex(enc.anchor) == (
        "0000" + "80bf" + pad + "003f" + "0000" + pad + "2064a8fc" + "00" * 4 + "00" * 8
    )
    # centred residual codes are all 0, stored +8
    assert _hex(enc.residual) == "88" * 8 + "00" * 8
    assert torch.equal(decode(enc.anchor, enc.residual, config=config, shape=x.shape, dtype=x.dtype), x)


def test_per_channel_key_bytes_are_pinned() -> None:
    config = CodecConfig(anchor_bits=3, group_size=8, key_block=2, residual="int8")
    keys = torch.tensor(
        [[0] * 8, [7, 14, 3.5, 0, -7, 7, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.bfloat16
    )
    enc = encode(keys, config, kind="key")
    # groups: block 0 (tokens 0-1) x 8 channels, then the partial block 1 (token 2)
    mins = "0000" * 4 + "e0c0" + "0000" * 3 + "803f0040404080 40a040c040e0400041".replace(" ", "")
    scales = "803f0040003f0000803f803f803f803f" + "0000" * 8
    # 3-bit codes, 8 per 3 bytes: token 0 [0,0,0,0,7,0,0,0], token 1 [7,7,7,0,0,7,7,7]
    codes = "007000" + "ff81ff" + "000000" + "00" * 7
    assert _hex(enc.anchor) == mins + scales + codes
    # 5-bit residual codes, all centred 0 (stored 16): 8 codes per 5 bytes
    assert _hex(enc.residual) == "1042082184" * 3 + "00"
    assert torch.equal(
        decode(enc.anchor, None, config=config, shape=keys.shape, dtype=keys.dtype, kind="key"),
        keys,
    )


def test_lossless_residual_bytes_are_pinned() -> None:
    """A part that codes no shorter than its words is stored raw: format byte 0, the words;
    a part that codes shorter: format byte 1, its table count, tables, the block table (the
    bits of each 512 values), bit stream."""
    x = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7.5], [-1] * 8], dtype=torch.bfloat16)
    enc = encode(x, CodecConfig(group_size=8))
    assert _hex(enc.residual) == "00" + x.view(torch.uint8).numpy().tobytes().hex()
    cubes = (torch.linspace(-3, 3, 1024) ** 3).view(16, 64).to(torch.bfloat16)
    table = lossless.word_format(torch.bfloat16).table_nbytes
    for kind, length, head, blocks, digest in (
        (
            "value",
            524,
            "010a",
            (1686, 1654),
            "91821939c20fa9e3308de7a9d7a753f0fe337979e1d758a2576e56c6c501d8c4",
        ),
        (
            "key",
            1223,
            "010a",
            (4449, 4486),
            "b8ac1dd1c57f184d0443fc8a9edaff378b242823cd219754c80b7400b282c181",
        ),
    ):
        body = encode(cubes, CodecConfig(), kind=kind).residual.numpy().tobytes()
        at = 2 + body[1] * table
        assert (len(body), body[:2].hex(), hashlib.sha256(body).hexdigest()) == (length, head, digest)
        assert struct.unpack_from("<2H", body, at) == blocks
        assert len(body) == at + 4 + -(-sum(blocks) // 8)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_code_packing_is_the_little_endian_bit_stream(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (64,), generator=gen, dtype=torch.uint8)
    stream = sum(int(c) << (bits * i) for i, c in enumerate(codes))
    expect = stream.to_bytes(64 * bits // 8, "little")
    packed = pack_codes(codes, bits)
    assert packed.numpy().tobytes() == expect
    assert torch.equal(unpack_codes(packed, bits), codes)
