"""Page-level codec: segments of token slots of an SGLang-style KV pool, in place."""

import pytest
import torch

from lynx.codec import (
    CodecConfig,
    CodecInputError,
    KVLayout,
    decode,
    decode_pages,
    encode,
    encode_pages,
    kv_layout_of,
    residual_layer_ends,
    residual_nbytes_of,
    segment_nbytes,
)
from lynx.codec.format import part_layout

LAYERS, HEADS, HEAD_DIM, ROWS = 3, 2, 32, 64


def _pool(dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(ROWS, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    v = [torch.randn(ROWS, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    return k, v


def _staging(n: int, config: CodecConfig, dtype=torch.bfloat16, offset: int = 32):
    """Views into one larger registered-style region, like the PD layer will hand us."""
    anchor_nbytes, residual_nbytes = segment_nbytes(KVLayout(LAYERS, HEADS, HEAD_DIM, dtype), n, config)
    region = torch.full((offset + anchor_nbytes + residual_nbytes + 16,), 0xAB, dtype=torch.uint8)
    anchor = region[offset : offset + anchor_nbytes]
    residual = region[offset + anchor_nbytes : offset + anchor_nbytes + residual_nbytes]
    return region, anchor, residual


CONFIGS = [
    CodecConfig(),
    CodecConfig(anchor_bits=3, group_size=8, key_block=4),
    CodecConfig(anchor_bits=2, residual="exact", key_layout="per_token", group_size=16),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_segment_round_trip_into_other_slots(config: CodecConfig, dtype: torch.dtype) -> None:
    k, v = _pool(dtype)
    src = torch.tensor(
        [5, 9, 2, 40, 41, 42, 7, 63, 0, 11, 12, 13, 30, 31, 32, 33, 34, 1, 3], dtype=torch.int64
    )
    region, anchor, residual = _staging(src.numel(), config, dtype)
    before = region.clone()
    encode_pages(k, v, src, config, anchor, residual)
    # bytes outside the segment's views are untouched
    untouched = torch.ones_like(region, dtype=torch.bool)
    untouched[32 : 32 + anchor.numel() + residual.numel()] = False
    assert torch.equal(region[untouched], before[untouched])

    dst = torch.randperm(ROWS)[: src.numel()]
    dk, dv = _pool(dtype, seed=1)
    keep_k = [t.clone() for t in dk]
    decode_pages(anchor, None, dk, dv, dst, config)
    at = 0
    for layer in range(LAYERS):
        for kind, pool, out in (("key", k, dk), ("value", v, dv)):
            part = pool[layer][src]
            enc = encode(part, config, kind=kind)
            # each part of the segment is the tensor API's bytes for the gathered rows
            assert torch.equal(anchor[at : at + enc.anchor.numel()], enc.anchor)
            at += enc.anchor.numel()
            expect = decode(enc.anchor, None, config=config, shape=part.shape, dtype=dtype, kind=kind)
            assert torch.equal(out[layer][dst], expect)
    assert at == anchor.numel()
    others = torch.ones(ROWS, dtype=torch.bool)
    others[dst] = False
    for layer in range(LAYERS):
        assert torch.equal(dk[layer][others], keep_k[layer][others])

    # refinement in place: decoding again with the residual gives the full reconstruction
    decode_pages(anchor, residual, dk, dv, dst, config)
    for layer in range(LAYERS):
        for kind, pool, out in (("key", k, dk), ("value", v, dv)):
            part = pool[layer][src]
            enc = encode(part, config, kind=kind)
            full = decode(enc.anchor, enc.residual, config=config, shape=part.shape, dtype=dtype, kind=kind)
            assert torch.equal(out[layer][dst], full)
            if config.residual == "exact":
                assert torch.equal(out[layer][dst], part)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_segment_residual_holds_its_parts_bodies_and_only_those_bytes_travel(config: CodecConfig) -> None:
    """A lossless segment Residual: its head's length and part ends, each body the tensor
    API's Residual of that part, zeros after them; the count is what residual_nbytes_of reads.
    Without a Residual buffer the Anchor is the same and nothing is coded."""
    k, v = _pool()
    src = torch.tensor([5, 9, 2, 40, 41, 42, 7, 63, 0, 11, 12, 13, 30, 31, 32, 33, 34], dtype=torch.int64)
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16)
    _, anchor, residual = _staging(src.numel(), config)
    used = encode_pages(k, v, src, config, anchor, residual)
    assert residual_nbytes_of(residual, src.numel(), layout, config) == used
    if not config.residual_is_variable:
        assert used == residual.numel()
    else:
        head = residual[: 4 * (1 + 2 * LAYERS)].view(torch.int32).tolist()
        assert head[0] == used and used % 16 == 0 and used < residual.numel()
        start = 4 * (1 + 2 * LAYERS)
        for index, end in enumerate(head[1:]):
            layer, kind = divmod(index, 2)
            pool = (k, v)[kind]
            body = encode(pool[layer][src], config, kind=("key", "value")[kind]).residual
            assert torch.equal(residual[start:end], body)
            start = end
        assert not residual[start:].any()
    alone = anchor.clone().fill_(0xAB)
    assert encode_pages(k, v, src, config, alone, None) == 0
    assert torch.equal(alone, anchor)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_landed_prefix_of_layers_decodes_on_its_own(config: CodecConfig) -> None:
    """``residual_layer_ends`` cuts a segment's Residual into its layers' bytes, in order,
    covering every travelling byte; with only the bytes up to layer ``l``'s end landed (the
    rest of the space garbage), ``decode_pages(layers=range(a, l + 1))`` writes exactly those
    layers' rows at full precision and leaves every other layer's rows as they were."""
    k, v = _pool()
    src = torch.tensor([5, 9, 2, 40, 41, 42, 7, 63, 0, 11, 12, 13, 30, 31, 32, 33, 34], dtype=torch.int64)
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16)
    _, anchor, residual = _staging(src.numel(), config)
    used = encode_pages(k, v, src, config, anchor, residual)
    ends = residual_layer_ends(residual, src.numel(), layout, config)
    assert len(ends) == LAYERS and ends[-1] == used
    assert all(a < b for a, b in zip([0, *ends[:-1]], ends, strict=True))
    for last in range(LAYERS):
        landed = residual.clone()
        landed[ends[last] :] = 0x5A  # not landed yet
        dk, dv = _pool(seed=1)
        decode_pages(anchor, None, dk, dv, src, config)
        anchor_only = [t.clone() for t in dk + dv]
        first = last // 2
        decode_pages(anchor, landed, dk, dv, src, config, layers=range(first, last + 1))
        for layer in range(LAYERS):
            for pool, out, before in ((k, dk, anchor_only[:LAYERS]), (v, dv, anchor_only[LAYERS:])):
                if first <= layer <= last and config.residual == "exact":
                    assert torch.equal(out[layer][src], pool[layer][src])
                elif not first <= layer <= last:
                    assert torch.equal(out[layer], before[layer])
    with pytest.raises(CodecInputError, match="layers"):
        decode_pages(anchor, residual, *_pool(seed=1), src, config, layers=range(1, LAYERS + 1))


def test_segments_of_one_request_start_key_blocks_at_their_first_token() -> None:
    config = CodecConfig(key_block=16)
    k, v = _pool()
    slots = torch.arange(40)
    whole = _staging(40, config)[1:]
    encode_pages(k, v, slots, config, *whole)
    first, second = _staging(16, config)[1:], _staging(24, config)[1:]
    encode_pages(k, v, slots[:16], config, *first)
    encode_pages(k, v, slots[16:], config, *second)
    dk, dv = _pool(seed=3)
    decode_pages(first[0], first[1], dk, dv, slots[:16], config)
    decode_pages(second[0], second[1], dk, dv, slots[16:], config)
    ek, ev = _pool(seed=4)
    decode_pages(whole[0], whole[1], ek, ev, slots, config)
    # 16 is a block boundary, so chunking changes nothing
    for layer in range(LAYERS):
        assert torch.equal(dk[layer][:40], ek[layer][:40])
        assert torch.equal(dv[layer][:40], ev[layer][:40])


def test_non_finite_input_names_layer_kind_token_and_slot() -> None:
    k, v = _pool()
    v[1][23, 1, 5] = float("nan")
    slots = torch.tensor([4, 23, 8])
    _, anchor, residual = _staging(3, CodecConfig())
    with pytest.raises(
        CodecInputError,
        match=r"layer 1 values at token 1 \(slot 23\), "
        r"channel 37 \(head 1, dim 5\)",
    ):
        encode_pages(k, v, slots, CodecConfig(), anchor, residual)
    k[0][8, 0, 0] = float("-inf")
    with pytest.raises(CodecInputError, match=r"-inf in layer 0 keys at token 2 \(slot 8\)"):
        encode_pages(k, v, slots, CodecConfig(), anchor, residual)
    with pytest.raises(CodecInputError, match="non-finite value inf"):
        encode(torch.tensor([[1.0] * 7 + [float("inf")]]), CodecConfig(group_size=8))


def test_corrupt_anchor_is_refused_before_any_row_is_written() -> None:
    config = CodecConfig()
    k, v = _pool()
    slots = torch.arange(8)
    _, anchor, residual = _staging(8, config)
    encode_pages(k, v, slots, config, anchor, residual)
    corrupt = anchor.clone()
    # the last part is layer 2 values: make its first scale a bf16 NaN
    part = part_layout(8, HEADS * HEAD_DIM, "value", config, torch.bfloat16)
    at = anchor.numel() - part.anchor_nbytes + part.scales_offset
    corrupt[at : at + 2] = torch.tensor([0xC0, 0x7F], dtype=torch.uint8)
    dk, dv = _pool(seed=5)
    keep = [t.clone() for t in dk + dv]
    with pytest.raises(CodecInputError, match="corrupt anchor layer 2 values"):
        decode_pages(corrupt, residual, dk, dv, slots, config)
    assert all(torch.equal(a, b) for a, b in zip(dk + dv, keep, strict=True))


def test_bad_arguments_raise() -> None:
    config = CodecConfig()
    k, v = _pool()
    slots = torch.arange(4)
    _, anchor, residual = _staging(4, config)
    with pytest.raises(CodecInputError, match="needs"):
        encode_pages(k, v, slots, config, anchor[:-16], residual)
    with pytest.raises(CodecInputError, match=r"0\.\.63"):
        encode_pages(k, v, torch.tensor([1, 64]), config, *_staging(2, config)[1:])
    with pytest.raises(CodecInputError, match="int64"):
        encode_pages(k, v, slots.int(), config, anchor, residual)
    with pytest.raises(CodecInputError, match="V"):
        encode_pages(k, v[:-1], slots, config, anchor, residual)
    with pytest.raises(CodecInputError, match="expected contiguous"):
        encode_pages([*k[:-1], k[0].half()], v, slots, config, anchor, residual)
    with pytest.raises(CodecInputError, match="does not divide head_dim"):
        encode_pages(k, v, slots, CodecConfig(group_size=64), anchor, residual)
    with pytest.raises(CodecInputError, match="uint8"):
        decode_pages(anchor.view(torch.int8), None, k, v, slots, config)
    with pytest.raises(CodecInputError, match="dtype"):
        encode(torch.zeros(2, 32, dtype=torch.int32), config)
    with pytest.raises(CodecInputError, match="multiple of group_size"):
        encode(torch.zeros(2, 24), config)
    with pytest.raises(CodecInputError, match="shape"):
        encode(torch.zeros(8), config, kind="key")
    assert kv_layout_of(k, v) == KVLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16)


def test_empty_segment_is_a_no_op() -> None:
    k, v = _pool()
    empty = torch.zeros(0, dtype=torch.int64)
    anchor = torch.empty(0, dtype=torch.uint8)
    encode_pages(k, v, empty, CodecConfig(), anchor, anchor)
    decode_pages(anchor, anchor, k, v, empty, CodecConfig())


def test_a_device_pools_lossless_residual_is_coded_and_decoded_on_the_host() -> None:
    """What a CUDA pool's part takes (there is no device coder yet): the host codes the
    gathered rows and decodes into a host part that is copied back; run here on host
    tensors, it writes the reference's bytes and the rows bit for bit."""
    from lynx.codec import backend, reference

    config = CodecConfig()
    k, _ = _pool()
    slots = torch.tensor([4, 17, 9, 1, 0, 33], dtype=torch.int64)
    layout = part_layout(slots.numel(), HEADS * HEAD_DIM, "key", config, torch.bfloat16)
    rows = k[0].view(ROWS, -1)
    expect_anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
    expect_residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
    used = reference.encode_part(rows[slots], "key", config, expect_anchor, expect_residual)
    residual = torch.full_like(expect_residual, 0x5A)
    assert backend._encode_lossless_on_host(rows[slots], "key", config, residual) == used
    assert torch.equal(residual, expect_residual)
    part = backend._decoded_part(
        expect_anchor, residual[:used], slots.numel(), rows.shape[1], rows.dtype, "key", config
    )
    assert torch.equal(part.view(torch.int16), rows[slots].view(torch.int16))
