"""Property tests of the codec math over shapes, dtypes, group sizes, layouts and bits."""

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx.codec import CodecConfig, decode, encode
from lynx.codec.format import part_layout

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Case:
    x: torch.Tensor
    config: CodecConfig
    kind: str


def _values(pattern: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    big = torch.finfo(dtype).max
    if pattern == "constant":
        x = torch.full(shape, float(x.flatten()[0]) * 3)
    elif pattern == "zeros":
        x = torch.zeros(shape)
    elif pattern == "tiny":  # subnormal in every dtype
        x = x * torch.finfo(dtype).smallest_normal * 0.25
    elif pattern == "huge":  # whole-range groups: max - min overflows the dtype
        x = torch.where(x > 0, big, -big) * torch.rand(shape, generator=gen).clamp_min(0.5)
    elif pattern == "outliers":  # a few channels 100x larger, plus an offset
        x = x + 40.0
        x[..., :: max(1, shape[-1] // 3)] *= 100
    elif pattern == "mixed_sign_zero":
        x[..., ::2] = -0.0
    return x.to(dtype)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    head_dim = draw(st.sampled_from([8, 16, 32, 64]))
    heads = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 37))
    config = CodecConfig(
        anchor_bits=draw(st.sampled_from([2, 3, 4])),
        group_size=draw(st.sampled_from([g for g in (8, 16, 32, 64) if g <= head_dim])),
        residual=draw(st.sampled_from(["int8", "exact"])),
        key_layout=draw(st.sampled_from(["per_channel", "per_token"])),
        key_block=draw(st.sampled_from([2, 4, 16, 32])),
    )
    dtype = draw(st.sampled_from(DTYPES))
    pattern = draw(
        st.sampled_from(["normal", "constant", "zeros", "tiny", "huge", "outliers", "mixed_sign_zero"])
    )
    x = _values(pattern, (tokens, heads, head_dim), dtype, draw(st.integers(0, 2**31)))
    return Case(x=x, config=config, kind=draw(st.sampled_from(["key", "value"])))


def _group_ranges(case: Case) -> torch.Tensor:
    """Per element: max - min of its group and 0.0 (the format's ``lo``/``hi`` include 0),
    computed independently of the codec (float64)."""
    x = case.x.double()
    tokens = x.shape[0]
    flat = x.reshape(tokens, -1)
    if case.kind == "key" and case.config.key_layout == "per_channel":
        out = torch.empty_like(flat)
        block = case.config.key_block
        for start in range(0, tokens, block):
            rows = flat[start : start + block]
            out[start : start + block] = rows.amax(0).clamp(min=0) - rows.amin(0).clamp(max=0)
        return out.reshape(x.shape)
    groups = x.reshape(*x.shape[:-1], -1, case.config.group_size)
    width = groups.amax(-1, keepdim=True).clamp(min=0) - groups.amin(-1, keepdim=True).clamp(max=0)
    return width.expand_as(groups).reshape(x.shape)


def _round_trip(case: Case, with_residual: bool) -> torch.Tensor:
    enc = encode(case.x, case.config, kind=case.kind)
    return decode(
        enc.anchor,
        enc.residual if with_residual else None,
        config=case.config,
        shape=case.x.shape,
        dtype=case.x.dtype,
        kind=case.kind,
    )


def _bound(case: Case, steps: float) -> torch.Tensor:
    """Allowed |error|: ``steps`` quantization steps of the group + output rounding."""
    finfo = torch.finfo(case.x.dtype)
    ranges = _group_ranges(case)
    step = ranges / ((1 << case.config.anchor_bits) - 1)
    # the stored scale is rounded up to the KV dtype (and to its smallest subnormal)
    step = torch.maximum(step * (1 + 2 * finfo.eps), torch.tensor(finfo.smallest_normal * finfo.eps))
    # the decode rounds terms as large as the group's extremes (lo * 0.5, w * scale * 0.5),
    # however small the value itself: a few ulps of the group's range, not of |x|
    rounding = (case.x.double().abs() + ranges + step) * finfo.eps * 2 + finfo.smallest_normal * finfo.eps
    return steps * step + rounding


@settings(max_examples=150, deadline=None)
@given(cases())
def test_anchor_only_error_is_half_an_anchor_step(case: Case) -> None:
    y = _round_trip(case, with_residual=False)
    assert y.dtype == case.x.dtype and y.shape == case.x.shape
    assert torch.isfinite(y).all()
    err = (y.double() - case.x.double()).abs()
    assert (err <= _bound(case, 0.5)).all(), float((err - _bound(case, 0.5)).max())


@settings(max_examples=150, deadline=None)
@given(cases())
def test_full_reconstruction_has_int8_resolution_or_is_exact(case: Case) -> None:
    y = _round_trip(case, with_residual=True)
    if case.config.residual == "exact":
        assert torch.equal(y.view(torch.uint8), case.x.view(torch.uint8))  # bit for bit, -0.0
        return
    assert torch.isfinite(y).all()
    # one step of the 2**(8-b) times finer grid (half a step except at exact ties)
    fine = 1.0 / (1 << case.config.residual_bits)
    err = (y.double() - case.x.double()).abs()
    assert (err <= _bound(case, fine)).all(), float((err - _bound(case, fine)).max())


@settings(max_examples=60, deadline=None)
@given(cases())
def test_byte_sizes_follow_the_format(case: Case) -> None:
    enc = encode(case.x, case.config, kind=case.kind)
    config, x = case.config, case.x
    tokens, channels = x.shape[0], x.shape[1] * x.shape[2]
    if case.kind == "key" and config.key_layout == "per_channel":
        groups = -(-tokens // config.key_block) * channels
    else:
        groups = tokens * channels // config.group_size

    def pad(n: int) -> int:
        return -(-n // 16) * 16

    params = pad(groups * x.element_size())
    assert enc.anchor.numel() == 2 * params + pad(tokens * channels * config.anchor_bits // 8)
    raw = tokens * channels * x.element_size()
    if config.residual == "exact":  # a lossless body: at most the raw words and its format byte
        assert 1 <= enc.residual.numel() <= 1 + raw
    else:
        assert enc.residual.numel() == pad(tokens * channels * (8 - config.anchor_bits) // 8)
    assert enc.anchor.dtype == enc.residual.dtype == torch.uint8
    assert enc.anchor.is_contiguous() and enc.residual.is_contiguous()
    layout = part_layout(tokens, channels, case.kind, config, x.dtype)
    assert layout.anchor_nbytes == enc.anchor.numel()
    assert layout.residual_nbytes == (1 + raw if config.residual == "exact" else enc.residual.numel())


@settings(max_examples=60, deadline=None)
@given(cases())
def test_encode_and_decode_are_stable(case: Case) -> None:
    first = encode(case.x, case.config, kind=case.kind)
    again = encode(case.x.clone(), case.config, kind=case.kind)
    assert torch.equal(first.anchor, again.anchor) and torch.equal(first.residual, again.residual)
    full = _round_trip(case, with_residual=True)
    # the full reconstruction re-encodes to itself within its own bound
    replay = Case(x=full, config=case.config, kind=case.kind)
    again_full = _round_trip(replay, with_residual=True)
    if case.config.residual == "exact":
        assert torch.equal(again_full.view(torch.uint8), full.view(torch.uint8))
    else:
        fine = 1.0 / (1 << case.config.residual_bits)
        assert ((again_full.double() - full.double()).abs() <= _bound(replay, fine)).all()
    # the anchor of an exact-mode encoding is the INT8-mode anchor
    other = CodecConfig(
        **{
            **case.config.__dict__,
            "residual": "exact" if case.config.residual == "int8" else "int8",
        }
    )
    assert torch.equal(encode(case.x, other, kind=case.kind).anchor, first.anchor)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([torch.bfloat16, torch.float16]), st.integers(0, 2**31))
def test_exact_mode_is_bit_exact_over_arbitrary_bit_patterns(dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (24, 2, 32), generator=gen, dtype=torch.int16)
    x = bits.view(dtype)
    x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=dtype))
    config = CodecConfig(residual="exact", group_size=16)
    for kind in ("key", "value"):
        enc = encode(x, config, kind=kind)
        y = decode(enc.anchor, enc.residual, config=config, shape=x.shape, dtype=dtype, kind=kind)
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))
        anchor_only = decode(enc.anchor, None, config=config, shape=x.shape, dtype=dtype, kind=kind)
        assert torch.isfinite(anchor_only).all()


def test_signed_zero_extremes_encode_the_same_whatever_their_order() -> None:
    # Which zero a min/max reduction returns depends on its order; the wire stores +0.0.
    config = CodecConfig()
    a = torch.tensor([0.0, -0.0] * 16 + [1.0] * 32, dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 0.0] * 16 + [1.0] * 32, dtype=torch.bfloat16)
    assert torch.equal(encode(a, config).anchor, encode(b, config).anchor)
    mins = encode(a, config).anchor[:4].view(torch.bfloat16)
    assert not torch.signbit(mins).any()
