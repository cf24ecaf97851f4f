"""Torch implementation of the codec math in ``format.py``: the CPU path and the oracle the
Triton kernels are tested against bit for bit.

A *part* is the ``(n_tokens, channels)`` matrix of one layer's K or V. Groups are exposed
as 3-D views ``(a, group, b)`` reduced over dim 1, so per-token groups (``(n*C/G, G, 1)``)
and per-channel key blocks (``(blocks, key_block, C)`` plus a partial tail block) share
one implementation; the flattened ``(a, b)`` order of the parameters is the wire's group
order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from . import lossless
from .format import CodecConfig, CodecInputError, Kind, PartLayout, part_layout


def round_up_to(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest value of ``dtype`` >= each non-negative float32 ``scale``."""
    if dtype == torch.float32:
        return scale
    if dtype == torch.bfloat16:
        return ((scale.view(torch.int32) + 0xFFFF) >> 16).to(torch.int16).view(torch.bfloat16)
    nearest = scale.to(torch.float16)
    below = (nearest.float() < scale).to(torch.int16)
    return (nearest.view(torch.int16) + below).view(torch.float16)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2**bits, count a multiple of 8) into ``count * bits / 8`` bytes."""
    if 8 % bits == 0:  # 2 or 4 bits: whole codes per byte, cheap uint8 arithmetic
        per_byte = codes.reshape(-1, 8 // bits)
        packed = per_byte[:, 0].clone()
        for j in range(1, 8 // bits):
            packed |= per_byte[:, j] << (bits * j)
        return packed
    groups = codes.reshape(-1, 8).to(torch.int64)
    code_shift = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (groups << code_shift).sum(-1, keepdim=True)
    byte_shift = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((words >> byte_shift) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: ``len(packed) * 8 / bits`` uint8 codes."""
    if 8 % bits == 0:
        shift = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        return ((packed.reshape(-1, 1) >> shift) & ((1 << bits) - 1)).reshape(-1)
    groups = packed.reshape(-1, bits).to(torch.int64)
    byte_shift = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (groups << byte_shift).sum(-1, keepdim=True)
    code_shift = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((words >> code_shift) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)


def group_views(part: torch.Tensor, kind: Kind, config: CodecConfig) -> list[torch.Tensor]:
    """3-D views of a contiguous (n, C) part whose dim 1 runs over one group's members."""
    n, channels = part.shape
    if kind == "value" or config.key_layout == "per_token":
        return [part.view(-1, config.group_size, 1)]
    block = config.key_block
    full = n // block * block
    views = []
    if full:
        views.append(part[:full].view(full // block, block, channels))
    if full < n:
        views.append(part[full:].view(1, n - full, channels))
    return views


def _to_anchor_position_(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x, in place: its position in anchor steps above the group minimum (0 in a constant
    group). In-place passes spare the allocations that dominate the eager CPU path."""
    half_step = scale.float() * 0.5
    divisor = torch.where(half_step > 0, half_step, torch.ones_like(half_step))
    return x.mul_(0.5).sub_(lo * 0.5).div_(divisor)


def encode_tensors(
    part: torch.Tensor, kind: Kind, config: CodecConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The arrays of one (n >= 1, C) part: group minimums and scales (KV dtype), packed
    anchor codes, packed residual codes (None for ``"exact"``) and whether all input was
    finite (a 0-d bool tensor)."""
    dtype = part.dtype
    levels = (1 << config.anchor_bits) - 1
    rbits = config.residual_bits
    centre = 1 << (rbits - 1)
    mins, scales, codes, fines, finite = [], [], [], [], []
    for view in group_views(part.to(torch.float32, copy=True), kind, config):
        # + 0.0 turns a -0.0 extreme into +0.0: which zero min/max return is order-dependent
        lo = view.amin(1, keepdim=True).add_(0.0)
        hi = view.amax(1, keepdim=True).add_(0.0)
        finite.append(torch.isfinite(lo).all() & torch.isfinite(hi).all())
        scale = round_up_to(((hi * 0.5 - lo * 0.5) / levels) * 2.0, dtype)
        t = _to_anchor_position_(view, lo, scale)
        u = torch.round(t).clamp_(0, levels)
        codes.append(u.to(torch.uint8))
        if config.residual == "int8":
            v = t.sub_(u).mul_(float(1 << rbits)).round_().clamp_(-centre, centre - 1)
            fines.append(v.add_(centre).to(torch.uint8))
        mins.append(lo.reshape(-1).to(dtype))
        scales.append(scale.reshape(-1))
    n, channels = part.shape
    packed_fine = None
    if fines:
        packed_fine = pack_codes(_ungroup(fines, n, channels), rbits)
    return (
        torch.cat(mins),
        torch.cat(scales),
        pack_codes(_ungroup(codes, n, channels), config.anchor_bits),
        packed_fine,
        torch.stack(finite).all(),
    )


def _ungroup(pieces: list[torch.Tensor], n: int, channels: int) -> torch.Tensor:
    """Element-order (n, C) tensor from the group views' pieces (inverse of group_views)."""
    if len(pieces) == 1:
        return pieces[0].view(n, channels)
    return torch.cat([p.reshape(-1, channels) for p in pieces]).view(n, channels)


def encode_part(
    part: torch.Tensor,
    kind: Kind,
    config: CodecConfig,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor,
    where: str = "",
    slots: torch.Tensor | None = None,
    head_dim: int | None = None,
) -> int:
    """Encode one (n, C) part into its Anchor and Residual byte ranges (see format.py);
    returns how many Residual bytes it wrote (the rest is zero): all of them for
    ``"int8"``, the lossless body's length for ``"exact"``.

    ``where``, ``slots`` and ``head_dim`` only enrich the error raised for non-finite input.
    """
    n, channels = part.shape
    dtype = part.dtype
    layout = part_layout(n, channels, kind, config, dtype)
    anchor_out.zero_()
    residual_out.zero_()
    if n == 0 and config.residual == "int8":
        return layout.residual_nbytes
    if n == 0:
        residual_out[0] = lossless.RAW
        return 1
    mins, scales, codes, fine, finite = encode_tensors(part, kind, config)
    if not bool(finite):
        raise_non_finite(part, where, slots, head_dim)
    params(anchor_out, layout, layout.mins_offset, dtype).copy_(mins)
    params(anchor_out, layout, layout.scales_offset, dtype).copy_(scales)
    anchor_out[layout.codes_offset : layout.codes_offset + codes.numel()] = codes
    if fine is not None:
        residual_out[: fine.numel()] = fine
        return layout.residual_nbytes
    anchor = decode_tensors(mins, scales, codes, None, kind, config, torch.empty_like(part))
    body = lossless.encode_body(
        lossless.unsigned_words(part),
        lossless.unsigned_words(anchor),
        lossless.unsigned_words(value_scales(scales, n, channels, kind, config)),
        dtype,
    )
    residual_out[: len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return len(body)


def value_scales(
    scales: torch.Tensor, n: int, channels: int, kind: Kind, config: CodecConfig
) -> torch.Tensor:
    """Each value's group scale, as an (n, C) tensor in element order."""
    if kind == "value" or config.key_layout == "per_token":
        return scales.repeat_interleave(config.group_size).view(n, channels)
    block = config.key_block
    per_block = scales.view(-1, channels)
    return per_block.repeat_interleave(block, dim=0)[:n]


def decode_tensors(
    mins: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    fine: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    out: torch.Tensor,
) -> torch.Tensor:
    """Reconstruction of one (n >= 1, C) part in out's dtype from its arrays (fine=None:
    Anchor only)."""
    n, channels = out.shape
    if fine is None:
        w = unpack_codes(codes, config.anchor_bits).float()
    else:
        # u + (v - centre) / 2**r, formed as the integer u * 2**r + v - centre and scaled by
        # a power of two: the same float32 value (both are exact), one conversion fewer.
        rbits = config.residual_bits
        fine_code = unpack_codes(codes, config.anchor_bits).to(torch.int16) << rbits
        fine_code += unpack_codes(fine, rbits)
        w = fine_code.sub_(1 << (rbits - 1)).float().mul_(1.0 / (1 << rbits))
    finite_max = torch.finfo(out.dtype).max
    pieces = []
    at = 0
    for w_view in group_views(w.view(n, channels), kind, config):
        shape = (w_view.shape[0], 1, w_view.shape[2])
        count = shape[0] * shape[2]
        half_step = scales[at : at + count].float().view(shape) * 0.5
        half_lo = mins[at : at + count].float().view(shape) * 0.5
        y = w_view.mul_(half_step).add_(half_lo).mul_(2.0)
        pieces.append(y.clamp_(-finite_max, finite_max).to(out.dtype))
        at += count
    return _ungroup(pieces, n, channels)


def decode_part(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    out: torch.Tensor,
) -> None:
    """Reconstruct one (n, C) part into ``out``; ``residual=None``: Anchor-only values."""
    n, channels = out.shape
    dtype = out.dtype
    layout = part_layout(n, channels, kind, config, dtype)
    if n == 0:
        return
    codes = anchor[layout.codes_offset : layout.codes_offset + n * channels * config.anchor_bits // 8]
    mins = params(anchor, layout, layout.mins_offset, dtype)
    scales = params(anchor, layout, layout.scales_offset, dtype)
    if residual is not None and config.residual == "exact":
        anchor_values = decode_tensors(mins, scales, codes, None, kind, config, out)
        words = lossless.decode_body(
            residual.cpu(),
            lossless.unsigned_words(anchor_values.cpu()),
            lossless.unsigned_words(value_scales(scales, n, channels, kind, config).cpu()),
            dtype,
        )
        out.copy_(lossless.float_words(words, dtype).view(n, channels))
        return
    fine = None
    if residual is not None:
        fine = residual[: n * channels * config.residual_bits // 8]
    out.copy_(decode_tensors(mins, scales, codes, fine, kind, config, out))


ANCHOR_FAULTS = (
    "",
    "a group minimum or scale is not finite",
    "a group scale is negative",
)
"""What anchor_params_faults' codes (indexes) mean; 0: none."""


def anchor_params_faults(
    anchors: Sequence[torch.Tensor], layouts: Sequence[PartLayout], dtype: torch.dtype
) -> list[int]:
    """Per part, the index into ANCHOR_FAULTS of the first fault of its anchor's group
    minimums and scales; one synchronisation for all parts."""
    mins = torch.cat(
        [params(a, lay, lay.mins_offset, dtype) for a, lay in zip(anchors, layouts, strict=True)]
    )
    scales = torch.cat(
        [params(a, lay, lay.scales_offset, dtype) for a, lay in zip(anchors, layouts, strict=True)]
    )
    starts = [0, *itertools.accumulate(lay.param_nbytes // dtype.itemsize for lay in layouts)]
    non_finite = range_counts(~(torch.isfinite(mins) & torch.isfinite(scales)), starts)
    negative = range_counts(~(scales >= 0), starts)
    counts = torch.stack([non_finite, negative], 1).tolist()
    return [1 if bad else 2 if below else 0 for bad, below in counts]


def range_counts(flags: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
    """How many ``flags`` are set in each of the consecutive ranges that ``starts`` begin
    (its last entry: where the last ends): a prefix sum, no atomics on a few counters."""
    prefix = torch.nn.functional.pad(torch.cumsum(flags.to(torch.int64), 0), (1, 0))
    at = torch.tensor(list(starts), device=flags.device)
    return prefix[at[1:]] - prefix[at[:-1]]


def raise_anchor_fault(fault: int, where: str) -> None:
    """Refuse a corrupt anchor (fault: an ANCHOR_FAULTS index, 0 passes)."""
    if fault:
        raise CodecInputError(f"corrupt anchor {where}: {ANCHOR_FAULTS[fault]}")


def check_buffer(buf: torch.Tensor, nbytes: int, what: str) -> None:
    """A codec byte buffer must be a contiguous 1-D uint8 tensor of exactly nbytes."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise CodecInputError(f"{what} buffer must be a contiguous 1-D uint8 tensor")
    if buf.numel() != nbytes:
        raise CodecInputError(f"{what} buffer has {buf.numel()} bytes, the format needs {nbytes}")


def params(buf: torch.Tensor, layout: PartLayout, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """The group minimums or scales (by offset) of a part's anchor, as a dtype view."""
    return buf[offset : offset + layout.param_nbytes].view(dtype)


def raise_non_finite(
    part: torch.Tensor, where: str, slots: torch.Tensor | None, head_dim: int | None
) -> None:
    """Raise CodecInputError naming the first non-finite value of an (n, C) part."""
    bad = (~torch.isfinite(part)).nonzero()
    token, channel = (int(i) for i in bad[0])
    slot = f" (slot {int(slots[token])})" if slots is not None else ""
    head = f" (head {channel // head_dim}, dim {channel % head_dim})" if head_dim else ""
    raise CodecInputError(
        f"non-finite value {part[token, channel].item()} {where} at token {token}{slot}, "
        f"channel {channel}{head}; {len(bad)} non-finite value(s) in this part"
    )
