"""Torch implementation of the codec math in ``format.py``: the CPU path and the oracle the
Triton kernels are tested against bit for bit.

A *part* is the ``(n_tokens, channels)`` matrix of one layer's K or V. Groups are exposed
as 3-D views ``(a, group, b)`` reduced over dim 1, so per-token groups (``(n*C/G, G, 1)``)
and per-channel key blocks (``(blocks, key_block, C)`` plus a partial tail block) share
one implementation; the flattened ``(a, b)`` order of the parameters is the wire's group
order.
"""

from __future__ import annotations

import torch

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
    groups = codes.reshape(-1, 8).to(torch.int64)
    code_shift = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (groups << code_shift).sum(-1, keepdim=True)
    byte_shift = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((words >> byte_shift) & 0xFF).to(torch.uint8).reshape(-1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: ``len(packed) * 8 / bits`` uint8 codes."""
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


def _anchor_position(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Position of x in anchor steps above the group minimum (0 in a constant group)."""
    half_step = scale.float() * 0.5
    divisor = torch.where(half_step > 0, half_step, torch.ones_like(half_step))
    return (x * 0.5 - lo * 0.5) / divisor


def encode_part(
    part: torch.Tensor,
    kind: Kind,
    config: CodecConfig,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor,
    where: str = "",
    slots: torch.Tensor | None = None,
    head_dim: int | None = None,
) -> None:
    """Encode one (n, C) part into its Anchor and Residual byte ranges (see format.py).

    ``where``, ``slots`` and ``head_dim`` only enrich the error raised for non-finite input.
    """
    n, channels = part.shape
    dtype = part.dtype
    layout = part_layout(n, channels, kind, config, dtype)
    anchor_out.zero_()
    residual_out.zero_()
    if n == 0:
        return
    x = part.float().contiguous()
    levels = (1 << config.anchor_bits) - 1
    views = group_views(x, kind, config)
    lows = [v.amin(1, keepdim=True) for v in views]
    highs = [v.amax(1, keepdim=True) for v in views]
    if not all(bool(torch.isfinite(t).all()) for t in lows + highs):
        raise_non_finite(part, where, slots, head_dim)
    codes = torch.empty((n, channels), dtype=torch.uint8, device=part.device)
    fine = torch.empty_like(codes) if config.residual == "int8" else None
    mins = params(anchor_out, layout, layout.mins_offset, dtype)
    scales = params(anchor_out, layout, layout.scales_offset, dtype)
    at = 0
    for view, code_view, fine_view, lo, hi in zip(
        views,
        group_views(codes, kind, config),
        group_views(fine, kind, config) if fine is not None else [None] * len(views),
        lows,
        highs,
        strict=True,
    ):
        scale = round_up_to(((hi * 0.5 - lo * 0.5) / levels) * 2.0, dtype)
        t = _anchor_position(view, lo, scale)
        u = torch.round(t).clamp_(0, levels)
        code_view.copy_(u)
        if fine_view is not None:
            rbits = config.residual_bits
            centre = 1 << (rbits - 1)
            v = torch.round((t - u) * float(1 << rbits)).clamp_(-centre, centre - 1)
            fine_view.copy_(v + centre)
        count = lo.numel()
        mins[at : at + count] = lo.reshape(-1).to(dtype)
        scales[at : at + count] = scale.reshape(-1)
        at += count
    anchor_codes = n * channels * config.anchor_bits // 8
    anchor_out[layout.codes_offset : layout.codes_offset + anchor_codes] = pack_codes(
        codes, config.anchor_bits
    )
    if fine is not None:
        residual_codes = n * channels * config.residual_bits // 8
        residual_out[:residual_codes] = pack_codes(fine, config.residual_bits)
    else:
        residual_out[: n * channels * dtype.itemsize].view(dtype).copy_(part.reshape(-1))


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
    if residual is not None and config.residual == "exact":
        out.copy_(residual[: n * channels * dtype.itemsize].view(dtype).view(n, channels))
        return
    mins = params(anchor, layout, layout.mins_offset, dtype).float()
    scales = params(anchor, layout, layout.scales_offset, dtype).float()
    anchor_codes = n * channels * config.anchor_bits // 8
    w = unpack_codes(
        anchor[layout.codes_offset : layout.codes_offset + anchor_codes], config.anchor_bits
    ).float()
    if residual is not None:
        rbits = config.residual_bits
        fine = unpack_codes(residual[: n * channels * rbits // 8], rbits).float()
        w = w + (fine - float(1 << (rbits - 1))) * (1.0 / (1 << rbits))
    w = w.view(n, channels)
    finite_max = torch.finfo(dtype).max
    at = 0
    for w_view, out_view in zip(
        group_views(w, kind, config), group_views(out, kind, config), strict=True
    ):
        shape = (w_view.shape[0], 1, w_view.shape[2])
        count = shape[0] * shape[2]
        half_step = scales[at : at + count].view(shape) * 0.5
        half_lo = mins[at : at + count].view(shape) * 0.5
        y = (w_view * half_step + half_lo) * 2.0
        out_view.copy_(y.clamp_(-finite_max, finite_max))
        at += count


def check_anchor_params(
    anchor: torch.Tensor, layout: PartLayout, dtype: torch.dtype, where: str
) -> None:
    """Refuse an anchor whose group minimums are not finite or scales not finite and >= 0."""
    mins = params(anchor, layout, layout.mins_offset, dtype)
    scales = params(anchor, layout, layout.scales_offset, dtype)
    if not (bool(torch.isfinite(mins).all()) and bool(torch.isfinite(scales).all())):
        raise CodecInputError(f"corrupt anchor {where}: a group minimum or scale is not finite")
    if not bool((scales >= 0).all()):
        raise CodecInputError(f"corrupt anchor {where}: a group scale is negative")


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
