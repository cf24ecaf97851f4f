"""Device dispatch of the part codec: Triton kernels for CUDA tensors, the torch reference
(``reference.py``) elsewhere. Both read rows of a 2-D ``(rows, channels)`` view, through
an optional ``slots`` index, and write the exact same bytes.
"""

from __future__ import annotations

import torch

from . import reference
from .format import CodecConfig, Kind, part_layout


def _use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def encode_rows(
    rows: torch.Tensor,
    slots: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor,
    where: str = "",
    head_dim: int | None = None,
) -> None:
    """Encode ``rows[slots]`` (all rows when slots is None) as one part."""
    n = rows.shape[0] if slots is None else slots.numel()
    layout = part_layout(n, rows.shape[1], kind, config, rows.dtype)
    reference.check_buffer(anchor_out, layout.anchor_nbytes, "anchor")
    reference.check_buffer(residual_out, layout.residual_nbytes, "residual")
    if _use_triton(rows):
        from . import triton_kernels

        triton_kernels.encode_rows(rows, slots, kind, config, layout, anchor_out, residual_out)
        lows = reference.params(anchor_out, layout, layout.mins_offset, rows.dtype)
        if not bool(torch.isfinite(lows).all()):
            part = rows if slots is None else rows.index_select(0, slots)
            reference.raise_non_finite(part, where, slots, head_dim)
        return
    part = rows if slots is None else rows.index_select(0, slots)
    reference.encode_part(part, kind, config, anchor_out, residual_out, where, slots, head_dim)


def decode_rows(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
) -> None:
    """Decode one part into ``rows[slots]`` (all rows when slots is None), in place.

    The caller has validated the buffers (``check_part_buffers``).
    """
    if _use_triton(rows):
        from . import triton_kernels

        n = rows.shape[0] if slots is None else slots.numel()
        layout = part_layout(n, rows.shape[1], kind, config, rows.dtype)
        triton_kernels.decode_rows(anchor, residual, rows, slots, kind, config, layout)
        return
    if slots is None:
        reference.decode_part(anchor, residual, kind, config, rows)
        return
    part = torch.empty((slots.numel(), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    reference.decode_part(anchor, residual, kind, config, part)
    rows.index_copy_(0, slots, part)


def check_part_buffers(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    n: int,
    channels: int,
    kind: Kind,
    config: CodecConfig,
    dtype: torch.dtype,
    where: str,
) -> None:
    """Validate sizes and anchor parameters before anything is written."""
    layout = part_layout(n, channels, kind, config, dtype)
    reference.check_buffer(anchor, layout.anchor_nbytes, f"anchor {where}")
    if residual is not None:
        reference.check_buffer(residual, layout.residual_nbytes, f"residual {where}")
    reference.check_anchor_params(anchor, layout, dtype, where)
