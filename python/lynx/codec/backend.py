"""Device dispatch of the part codec: Triton kernels for CUDA tensors; on the CPU the fused
C++ codec (``cpp_backend.py``) when it builds, else the torch reference (``reference.py``).
All read rows of a 2-D ``(rows, channels)`` view, through an optional ``slots`` index, and
write the exact same bytes.

``LYNX_CODEC_BACKEND`` picks the CPU path: ``reference`` (torch) or ``cpp`` (the C++ codec;
a build failure then raises); unset, the C++ codec is used when it builds, the reference
(with one logged warning) when it does not.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from . import cpp_backend, reference
from .cpp_backend import PartIO
from .format import CodecConfig, CodecInputError, Kind, part_layout

BACKEND_ENV = "LYNX_CODEC_BACKEND"


def _use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _use_cpp(rows: torch.Tensor) -> bool:
    """Whether a CPU part goes to the C++ codec (read from the environment on every call)."""
    choice = os.environ.get(BACKEND_ENV, "")
    if choice == "reference":
        return False
    if choice == "cpp":
        cpp_backend.module()
        return rows.is_contiguous()
    if choice:
        raise CodecInputError(f"{BACKEND_ENV} must be 'reference' or 'cpp', got {choice!r}")
    return rows.is_contiguous() and cpp_backend.available()


def warm_up(device: torch.device | str) -> None:
    """Load (or build) what encoding and decoding on ``device`` will use, now rather than on
    a server's first request. On the CPU that is the C++ codec; a build failure is logged
    there and the torch reference serves instead."""
    if torch.device(device).type == "cpu":
        cpp_backend.available()


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
    if _use_cpp(rows):
        (finite,) = cpp_backend.encode_parts([PartIO(rows, kind, anchor_out, residual_out)], slots, config)
        if finite:
            return
        # Non-finite input: the reference zeroes the buffers and raises its located error.
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
    n = rows.shape[0] if slots is None else slots.numel()
    layout = part_layout(n, rows.shape[1], kind, config, rows.dtype)
    if _use_triton(rows):
        from . import triton_kernels

        triton_kernels.decode_rows(anchor, residual, rows, slots, kind, config, layout)
        return
    if _use_cpp(rows):
        cpp_backend.decode_parts([PartIO(rows, kind, anchor, residual)], slots, config)
        return
    if slots is None:
        reference.decode_part(anchor, residual, kind, config, rows)
        return
    part = torch.empty((slots.numel(), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    reference.decode_part(anchor, residual, kind, config, part)
    rows.index_copy_(0, slots, part)


def encode_parts(
    parts: Sequence[PartIO],
    wheres: Sequence[str],
    slots: torch.Tensor,
    config: CodecConfig,
    head_dim: int,
) -> None:
    """``encode_rows`` of several parts (in wire order; ``wheres`` name them in errors); the
    C++ codec runs them all in one parallel region."""
    if not (parts and _use_cpp(parts[0].rows)) or not all(part.rows.is_contiguous() for part in parts):
        for part, where in zip(parts, wheres, strict=True):
            encode_rows(part.rows, slots, part.kind, config, part.anchor, part.residual, where, head_dim)
        return
    for part in parts:
        layout = part_layout(slots.numel(), part.rows.shape[1], part.kind, config, part.rows.dtype)
        reference.check_buffer(part.anchor, layout.anchor_nbytes, "anchor")
        reference.check_buffer(part.residual, layout.residual_nbytes, "residual")
    for part, where, finite in zip(
        parts, wheres, cpp_backend.encode_parts(parts, slots, config), strict=True
    ):
        if not finite:  # the reference zeroes this part's buffers and raises its located error
            part_rows = part.rows.index_select(0, slots)
            reference.encode_part(
                part_rows, part.kind, config, part.anchor, part.residual, where, slots, head_dim
            )


def decode_parts(parts: Sequence[PartIO], slots: torch.Tensor, config: CodecConfig) -> None:
    """``decode_rows`` of several validated parts; the C++ codec runs them all in one
    parallel region."""
    if parts and _use_cpp(parts[0].rows) and all(part.rows.is_contiguous() for part in parts):
        cpp_backend.decode_parts(parts, slots, config)
        return
    for part in parts:
        decode_rows(part.anchor, part.residual, part.rows, slots, part.kind, config)


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
    if _use_cpp(anchor):
        fault = cpp_backend.anchor_params_fault(anchor, layout, dtype)
    else:
        fault = reference.anchor_params_fault(anchor, layout, dtype)
    reference.raise_anchor_fault(fault, where)
