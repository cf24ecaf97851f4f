"""Triton kernels of the codec: encode, Anchor-only decode and full decode, reading and
writing KV pool rows through a slot index (SGLang's per-layer (rows, heads, head_dim)
buffers, seen as (rows, channels)).

They follow the float32 operation order of ``format.py`` step for step, with IEEE
division (``div_rn``), round-half-even by the 1.5 * 2**23 trick and FMA contraction
disabled, so they write the same bytes and values as ``reference.py`` (tested under
``TRITON_INTERPRET=1``). They write the Anchor and an INT8 Residual; a lossless Residual
is coded by ``lossless_cuda.py``, whose contexts the Anchor decode also writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import lossless
from .format import CodecConfig, Kind, PartLayout

_PARAM_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_PARAM_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_TILE = 4096  # elements per program


@triton.jit
def _round_half_even(t):
    return (t + 12582912.0) - 12582912.0


@triton.jit
def _load_float32(ptr, mask):
    """Load ptr's values as float32. bf16 is widened here from its bits: the interpreter's
    own bf16->float32 cast loses subnormals."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = tl.load(ptr.to(tl.pointer_type(tl.int16)), mask=mask, other=0)
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0).to(tl.float32)


@triton.jit
def _store_rounded(ptr, y, mask):
    """Store float32 y with round-to-nearest-even into ptr's dtype; returns the stored
    word (int32). bf16 is rounded here in integer arithmetic: the interpreter's own
    float32->bf16 cast does not round to even."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptr, bits.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        return bits
    elif ptr.dtype.element_ty == tl.float16:
        value = y.to(tl.float16)
        tl.store(ptr, value, mask=mask)
        return value.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        tl.store(ptr, y, mask=mask)
        return y.to(tl.int32, bitcast=True)


@triton.jit
def _quantize(
    x,
    lo,
    hi,
    store_mask,
    mins_ptr,
    scales_ptr,
    group,
    BITS: tl.constexpr,
    PARAM: tl.constexpr,
    RESIDUAL_BITS: tl.constexpr,
):
    """Store the group minimum and rounded-up scale; return (anchor codes, residual codes)."""
    levels: tl.constexpr = (1 << BITS) - 1
    lo = lo + 0.0  # -0.0 -> +0.0, as the reference (format.py)
    hi = hi + 0.0
    raw = tl.math.div_rn(hi * 0.5 - lo * 0.5, levels * 1.0) * 2.0
    if PARAM == 0:
        bits = (raw.to(tl.int32, bitcast=True) + 0xFFFF) >> 16
        scale = (bits << 16).to(tl.float32, bitcast=True)
        tl.store(scales_ptr + group, bits.to(tl.int16), mask=store_mask)
        _store_rounded(mins_ptr + group, lo, store_mask)
    elif PARAM == 1:
        nearest = raw.to(tl.float16)
        bits = nearest.to(tl.int16, bitcast=True) + (nearest.to(tl.float32) < raw).to(tl.int16)
        scale = bits.to(tl.float16, bitcast=True).to(tl.float32)
        tl.store(scales_ptr + group, bits, mask=store_mask)
        _store_rounded(mins_ptr + group, lo, store_mask)
    else:
        scale = raw
        tl.store(scales_ptr + group, raw.to(tl.int32, bitcast=True), mask=store_mask)
        _store_rounded(mins_ptr + group, lo, store_mask)
    half_step = scale * 0.5
    divisor = tl.where(half_step > 0, half_step, 1.0)
    t = tl.math.div_rn(x * 0.5 - lo * 0.5, divisor)
    u = tl.minimum(tl.maximum(_round_half_even(t), 0.0), levels * 1.0)
    centre: tl.constexpr = 1 << (RESIDUAL_BITS - 1)
    v = _round_half_even((t - u) * (1 << RESIDUAL_BITS) * 1.0)
    v = tl.minimum(tl.maximum(v, -centre * 1.0), centre - 1.0) + centre
    return u.to(tl.int64), v.to(tl.int64)


@triton.jit
def _store_packed(ptr, word_index, codes, j, mask, BITS: tl.constexpr):
    """Pack the last axis (8 codes) into BITS little-endian bytes at ptr[word_index*BITS]."""
    word = tl.sum(codes << (j.to(tl.int64) * BITS), axis=len(codes.shape) - 1, keep_dims=True)
    for i in tl.static_range(BITS):
        tl.store(ptr + word_index * BITS + i, ((word >> (8 * i)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _load_packed(ptr, word_index, j, mask, BITS: tl.constexpr):
    """Codes (last axis: 8) of the words at ptr[word_index*BITS]; inverse of _store_packed."""
    word = tl.load(ptr + word_index * BITS, mask=mask, other=0).to(tl.int64)
    for i in tl.static_range(1, BITS):
        byte = tl.load(ptr + word_index * BITS + i, mask=mask, other=0)
        word = word | (byte.to(tl.int64) << (8 * i))
    return ((word >> (j.to(tl.int64) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _non_finite_to_nan(lo, x, mask, axis0: tl.constexpr, axis1: tl.constexpr):
    """lo, or NaN where the group holds a NaN/Inf (min/max do not reliably propagate NaN)."""
    bad = tl.where(mask & ((x - x) != 0), 1, 0)
    bad = tl.max(bad, axis=axis0, keep_dims=True)
    if axis1 >= 0:
        bad = tl.max(bad, axis=axis1, keep_dims=True)
    return tl.where(bad > 0, float("nan"), lo)


@triton.jit
def _encode_token_groups(
    rows_ptr,
    row_stride,
    slots_ptr,
    n,
    mins_ptr,
    scales_ptr,
    codes_ptr,
    residual_ptr,
    C: tl.constexpr,
    G: tl.constexpr,
    GROUPS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BITS: tl.constexpr,
    PARAM: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Per-token groups: a tile of (tokens, groups, words, 8 codes)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None, None]
    g = tl.arange(0, GROUPS_PAD)[None, :, None, None]
    w = tl.arange(0, G // 8)[None, None, :, None]
    j = tl.arange(0, 8)[None, None, None, :]
    channel = g * G + w * 8 + j
    group_mask = (t < n) & (g < C // G)
    slot = tl.load(slots_ptr + t, mask=t < n, other=0)
    x = _load_float32(rows_ptr + slot * row_stride + channel, group_mask)
    lo = tl.min(
        tl.min(tl.where(group_mask, x, float("inf")), axis=3, keep_dims=True),
        axis=2,
        keep_dims=True,
    )
    hi = tl.max(
        tl.max(tl.where(group_mask, x, -float("inf")), axis=3, keep_dims=True),
        axis=2,
        keep_dims=True,
    )
    lo = _non_finite_to_nan(lo, x, group_mask, 3, 2)
    u, v = _quantize(x, lo, hi, group_mask, mins_ptr, scales_ptr, t * (C // G) + g, BITS, PARAM, 8 - BITS)
    word_index = t * (C // 8) + g * (G // 8) + w
    _store_packed(codes_ptr, word_index, u, j, group_mask, BITS)
    if not EXACT:  # a lossless Residual is coded by lossless_cuda.py
        _store_packed(residual_ptr, word_index, v, j, group_mask, 8 - BITS)


@triton.jit
def _encode_key_blocks(
    rows_ptr,
    row_stride,
    slots_ptr,
    n,
    mins_ptr,
    scales_ptr,
    codes_ptr,
    residual_ptr,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    WORDS: tl.constexpr,
    BITS: tl.constexpr,
    PARAM: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Per-channel key groups: a tile of (BLOCK tokens, WORDS words, 8 channels)."""
    block = tl.program_id(0)
    t = block * BLOCK + tl.arange(0, BLOCK)[:, None, None]
    w = tl.program_id(1) * WORDS + tl.arange(0, WORDS)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    channel = w * 8 + j
    mask = (t < n) & (w < C // 8)
    slot = tl.load(slots_ptr + t, mask=t < n, other=0)
    x = _load_float32(rows_ptr + slot * row_stride + channel, mask)
    lo = tl.min(tl.where(mask, x, float("inf")), axis=0, keep_dims=True)
    hi = tl.max(tl.where(mask, x, -float("inf")), axis=0, keep_dims=True)
    lo = _non_finite_to_nan(lo, x, mask, 0, -1)
    u, v = _quantize(x, lo, hi, w < C // 8, mins_ptr, scales_ptr, block * C + channel, BITS, PARAM, 8 - BITS)
    word_index = t * (C // 8) + w
    _store_packed(codes_ptr, word_index, u, j, mask, BITS)
    if not EXACT:  # a lossless Residual is coded by lossless_cuda.py
        _store_packed(residual_ptr, word_index, v, j, mask, 8 - BITS)


@triton.jit
def _decode(
    rows_ptr,
    row_stride,
    slots_ptr,
    n,
    mins_ptr,
    scales_ptr,
    codes_ptr,
    residual_ptr,
    context_ptr,
    max_value,
    C: tl.constexpr,
    WORDS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BITS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    KEY_BLOCK: tl.constexpr,
    G: tl.constexpr,
    CONTEXTS: tl.constexpr,
    FRACTION_BITS: tl.constexpr,
    EXPONENT_MASK: tl.constexpr,
    SYMBOLS: tl.constexpr,
):
    """Dequantize (tokens, words, 8 codes) and write rows[slots]; KEY_BLOCK > 0 selects
    per-channel key groups, else per-token groups of G. CONTEXTS: also each value's
    lossless context (``lossless.contexts``) in element order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    w = tl.arange(0, WORDS_PAD)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    word_mask = (t < n) & (w < C // 8)
    word_index = t * (C // 8) + w
    value = _load_packed(codes_ptr, word_index, j, word_mask, BITS)
    if HAS_RESIDUAL:
        fine = _load_packed(residual_ptr, word_index, j, word_mask, 8 - BITS)
        value = value + (fine - (1 << (8 - BITS - 1)) * 1.0) * (1.0 / (1 << (8 - BITS)))
    channel = w * 8 + j
    if KEY_BLOCK > 0:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        group = (t // KEY_BLOCK) * C + channel
    else:
        group = t * (C // G) + channel // G
    mask = word_mask & (j < 8)
    half_step = _load_float32(scales_ptr + group, mask) * 0.5
    half_lo = _load_float32(mins_ptr + group, mask) * 0.5
    y = (value * half_step + half_lo) * 2.0
    y = tl.minimum(tl.maximum(y, -max_value), max_value)
    slot = tl.load(slots_ptr + t, mask=t < n, other=0)
    word = _store_rounded(rows_ptr + slot * row_stride + channel, y, mask)
    if CONTEXTS:
        scale_words = scales_ptr.to(tl.pointer_type(tl.int16))
        scale_word = tl.load(scale_words + group, mask=mask, other=0).to(tl.int32)
        context = ((scale_word >> FRACTION_BITS) & EXPONENT_MASK) - ((word >> FRACTION_BITS) & EXPONENT_MASK)
        context = tl.minimum(tl.maximum(context + FRACTION_BITS, 0), SYMBOLS - 1)
        tl.store(context_ptr + t * C + channel, context, mask=mask)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _param_views(
    anchor: torch.Tensor, layout: PartLayout, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mins = anchor[layout.mins_offset : layout.mins_offset + layout.param_nbytes].view(dtype)
    scales = anchor[layout.scales_offset : layout.scales_offset + layout.param_nbytes]
    return mins, scales.view(_PARAM_BITS[dtype]), anchor[layout.codes_offset :]


def _slots_or_all(slots: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) if slots is None else slots


def encode_rows(
    rows: torch.Tensor,
    slots: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    layout: PartLayout,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor,
) -> None:
    """Encode rows[slots] (an (R, C) view with unit channel stride) as one part."""
    n, channels = layout.n_tokens, layout.channels
    anchor_out.zero_()
    residual_out.zero_()
    if n == 0:
        return
    slots = _slots_or_all(slots, n, rows.device)
    mins, scales, codes = _param_views(anchor_out, layout, rows.dtype)
    exact = config.residual == "exact"
    residual = residual_out
    common = {
        "BITS": config.anchor_bits,
        "PARAM": _PARAM_CODES[rows.dtype],
        "EXACT": exact,
        "enable_fp_fusion": False,
    }
    args = (rows, rows.stride(0), slots, n, mins, scales, codes, residual)
    if kind == "key" and config.key_layout == "per_channel":
        block = config.key_block
        words = min(_next_pow2(channels // 8), max(1, _TILE // (8 * block)))
        grid = (triton.cdiv(n, block), triton.cdiv(channels // 8, words))
        _encode_key_blocks[grid](*args, C=channels, BLOCK=block, WORDS=words, **common)
        return
    groups_pad = _next_pow2(channels // config.group_size)
    block_t = max(1, _TILE // (groups_pad * config.group_size))
    _encode_token_groups[(triton.cdiv(n, block_t),)](
        *args, C=channels, G=config.group_size, GROUPS_PAD=groups_pad, BLOCK_T=block_t, **common
    )


def decode_rows(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    layout: PartLayout,
    contexts_out: torch.Tensor | None = None,
) -> None:
    """Write the reconstruction of one part into rows[slots] (Anchor-only if no residual);
    ``contexts_out`` (int32, n * C, 16-bit words only): also each value's lossless context
    as ``lossless.contexts`` defines it, from its Anchor-only word and its group's scale."""
    n, channels = layout.n_tokens, layout.channels
    if n == 0:
        return
    if residual is not None and config.residual_is_variable:
        raise ValueError("a lossless Residual is decoded by lossless_cuda.py, not by this kernel")
    slots = _slots_or_all(slots, n, rows.device)
    mins, scales, codes = _param_views(anchor, layout, rows.dtype)
    words_pad = _next_pow2(channels // 8)
    block_t = max(1, _TILE // (8 * words_pad))
    per_channel = kind == "key" and config.key_layout == "per_channel"
    fmt = lossless.word_format(rows.dtype)
    _decode[(triton.cdiv(n, block_t),)](
        rows,
        rows.stride(0),
        slots,
        n,
        mins,
        scales.view(rows.dtype),
        codes,
        codes if residual is None else residual,
        codes if contexts_out is None else contexts_out,
        torch.finfo(rows.dtype).max,
        C=channels,
        WORDS_PAD=words_pad,
        BLOCK_T=block_t,
        BITS=config.anchor_bits,
        HAS_RESIDUAL=residual is not None,
        KEY_BLOCK=config.key_block if per_channel else 0,
        G=config.group_size,
        CONTEXTS=contexts_out is not None,
        FRACTION_BITS=fmt.fraction_bits,
        EXPONENT_MASK=(1 << (fmt.word_bits - 1 - fmt.fraction_bits)) - 1,
        SYMBOLS=fmt.symbols,
        enable_fp_fusion=False,
    )
