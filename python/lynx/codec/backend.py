"""Device dispatch of the part codec: Triton kernels for CUDA tensors (and
``lossless_cuda.py`` for a lossless Residual of 16-bit words); on the CPU the fused C++
codec (``cpp_backend.py``, compiled when the package is installed) when it loads, else
the torch reference (``reference.py``). All read rows of a 2-D ``(rows, channels)`` view,
through an optional ``slots`` index, and write the exact same bytes.

``LYNX_CODEC_BACKEND`` picks the CPU path: ``reference`` (torch) or ``cpp`` (the C++ codec;
a missing build then raises); unset, the C++ codec is used when it loads, the reference
(with one logged warning) when it does not.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Literal

import torch

from . import cpp_backend, reference
from .cpp_backend import PartIO
from .format import CodecConfig, CodecInputError, Kind, PartLayout, part_layout

BACKEND_ENV = "LYNX_CODEC_BACKEND"


def _use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


CodecBackend = Literal["triton", "cpp", "reference"]


def _cpu_backend() -> CodecBackend:
    """The CPU path (read from the environment on every call)."""
    choice = os.environ.get(BACKEND_ENV, "")
    if choice == "reference":
        return "reference"
    if choice == "cpp":
        cpp_backend.module()
        return "cpp"
    if choice:
        raise CodecInputError(f"{BACKEND_ENV} must be 'reference' or 'cpp', got {choice!r}")
    return "cpp" if cpp_backend.available() else "reference"


def _use_cpp(rows: torch.Tensor) -> bool:
    """Whether a part goes to the C++ codec: a contiguous CPU one, where it is chosen."""
    return rows.device.type == "cpu" and _cpu_backend() == "cpp" and rows.is_contiguous()


def warm_up(device: torch.device | str) -> CodecBackend:
    """Load what encoding and decoding on ``device`` will use, now rather than on a server's
    first request, and name it. The C++ codec is loaded on every device (a CUDA pool's
    Huffman codes are built on the host, and an fp32 pool's lossless Residual is coded
    there): where it does not load, a warning says why and the torch reference serves."""
    cpu = _cpu_backend()
    return "triton" if torch.device(device).type == "cuda" else cpu


def encode_rows(
    rows: torch.Tensor,
    slots: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor,
    where: str = "",
    head_dim: int | None = None,
) -> int:
    """Encode ``rows[slots]`` (all rows when slots is None) as one part; returns the
    Residual bytes written (``reference.encode_part``)."""
    n = rows.shape[0] if slots is None else slots.numel()
    layout = part_layout(n, rows.shape[1], kind, config, rows.dtype)
    reference.check_buffer(anchor_out, layout.anchor_nbytes, "anchor")
    reference.check_buffer(residual_out, layout.residual_nbytes, "residual")
    if _use_triton(rows):
        all_rows = torch.arange(n, device=rows.device) if slots is None else slots
        (used,) = _encode_on_device(
            [PartIO(rows, kind, anchor_out, residual_out)], [where], all_rows, config, head_dim
        )
        return used
    if _use_cpp(rows):
        (used,) = cpp_backend.encode_parts([PartIO(rows, kind, anchor_out, residual_out)], slots, config)
        if used >= 0:
            return used
        # Non-finite input: the reference zeroes the buffers and raises its located error.
    part = rows if slots is None else rows.index_select(0, slots)
    return reference.encode_part(part, kind, config, anchor_out, residual_out, where, slots, head_dim)


def enqueue_parts_on_device(
    parts: Sequence[PartIO], slots: torch.Tensor, config: CodecConfig
) -> list[PartLayout]:
    """The Triton kernels of ``encode_parts`` on CUDA parts (the Anchor, and the Residual of
    a fixed-size one), enqueued on the current stream; nothing is read back, so no value is
    checked. Returns each part's layout."""
    from . import triton_kernels

    layouts = []
    for part in parts:
        layout = part_layout(slots.numel(), part.rows.shape[1], part.kind, config, part.rows.dtype)
        reference.check_buffer(part.anchor, layout.anchor_nbytes, "anchor")
        reference.check_buffer(part.residual, layout.residual_nbytes, "residual")
        triton_kernels.encode_rows(part.rows, slots, part.kind, config, layout, part.anchor, part.residual)
        layouts.append(layout)
    return layouts


def _encode_on_device(
    parts: Sequence[PartIO],
    wheres: Sequence[str],
    slots: torch.Tensor,
    config: CodecConfig,
    head_dim: int | None,
) -> list[int]:
    """``encode_parts`` of CUDA parts: the Triton kernels, then a lossless Residual coded
    on the device (``lossless_cuda``), or on the host for 32-bit words."""
    from . import lossless_cuda

    dtype = parts[0].rows.dtype
    layouts = enqueue_parts_on_device(parts, slots, config)
    lows = [
        reference.params(part.anchor, layout, layout.mins_offset, dtype)
        for part, layout in zip(parts, layouts, strict=True)
    ]
    starts = [0, *itertools.accumulate(low.numel() for low in lows)]
    non_finite = reference.range_counts(
        ~torch.isfinite(torch.cat(lows)), starts
    ).tolist()  # one synchronisation
    for part, where, bad in zip(parts, wheres, non_finite, strict=True):
        if bad:
            reference.raise_non_finite(part.rows.index_select(0, slots), where, slots, head_dim)
    if not config.residual_is_variable:
        return [layout.residual_nbytes for layout in layouts]
    values = [part.rows.index_select(0, slots) for part in parts]
    if lossless_cuda.supports(dtype):
        return lossless_cuda.encode_bodies(
            [
                lossless_cuda.LosslessPart(part.anchor, part.kind, x.shape)
                for part, x in zip(parts, values, strict=True)
            ],
            values,
            config,
            [part.residual for part in parts],
        )
    return [
        _encode_lossless_on_host(x, part.kind, config, part.residual)
        for part, x in zip(parts, values, strict=True)
    ]


def _encode_lossless_on_host(
    part: torch.Tensor, kind: Kind, config: CodecConfig, residual_out: torch.Tensor
) -> int:
    """The lossless Residual of a part (its rows gathered) whose Anchor a device kernel
    wrote, for words ``lossless_cuda`` does not code: coded on the host, where the Anchor
    is encoded again bit for bit, and copied back."""
    host = part.cpu()
    layout = part_layout(host.shape[0], host.shape[1], kind, config, host.dtype)
    anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
    residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
    used = encode_rows(host, None, kind, config, anchor, residual)
    residual_out.copy_(residual)
    return used


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
    lossless_residual = residual is not None and config.residual_is_variable
    if _use_triton(rows) and not lossless_residual:
        from . import triton_kernels

        layout = part_layout(n, rows.shape[1], kind, config, rows.dtype)
        triton_kernels.decode_rows(anchor, residual, rows, slots, kind, config, layout)
        return
    if lossless_residual and _lossless_on_device(rows):
        all_rows = torch.arange(n, device=rows.device) if slots is None else slots
        decode_parts([PartIO(rows, kind, anchor, residual)], all_rows, config, ["the part"])
        return
    if _use_cpp(rows):
        _raise_residual_faults(
            cpp_backend.decode_parts([PartIO(rows, kind, anchor, residual)], slots, config)
        )
        return
    if slots is None and rows.device.type == "cpu":
        reference.decode_part(anchor, residual, kind, config, rows)
        return
    part = _decoded_part(anchor, residual, n, rows.shape[1], rows.dtype, kind, config)
    if slots is None:
        rows.copy_(part)
    else:
        rows.index_copy_(0, slots, part.to(rows.device))


def _decoded_part(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    n: int,
    channels: int,
    dtype: torch.dtype,
    kind: Kind,
    config: CodecConfig,
) -> torch.Tensor:
    """One part's reconstruction as a new (n, C) tensor; a lossless Residual of a device
    pool that ``lossless_cuda`` does not decode is decoded on the host."""
    if residual is not None and config.residual_is_variable and anchor.device.type != "cpu":
        anchor, residual = anchor.cpu(), residual.cpu()
    part = torch.empty((n, channels), dtype=dtype, device=anchor.device)
    decode_rows(anchor, residual, part, None, kind, config)
    return part


def _lossless_on_device(rows: torch.Tensor) -> bool:
    """Whether a lossless Residual of these CUDA rows is coded where they are."""
    from . import lossless_cuda

    return _use_triton(rows) and lossless_cuda.supports(rows.dtype)


def _raise_residual_faults(faults: Sequence[int], wheres: Sequence[str] | None = None) -> None:
    """Refuse the first part whose lossless Residual the C++ codec found corrupt (nothing
    was written then)."""
    for index, fault in enumerate(faults):
        if fault:
            where = f" of {wheres[index]}" if wheres else ""
            raise CodecInputError(f"corrupt lossless residual{where}: {cpp_backend.RESIDUAL_FAULTS[fault]}")


def encode_parts(
    parts: Sequence[PartIO],
    wheres: Sequence[str],
    slots: torch.Tensor,
    config: CodecConfig,
    head_dim: int,
) -> list[int]:
    """``encode_rows`` of several parts (in wire order; ``wheres`` name them in errors); the
    C++ codec runs them all in one parallel region. Returns each part's Residual bytes."""
    if parts and _use_triton(parts[0].rows):
        return _encode_on_device(parts, wheres, slots, config, head_dim)
    if not (parts and _use_cpp(parts[0].rows)) or not all(part.rows.is_contiguous() for part in parts):
        return [
            encode_rows(part.rows, slots, part.kind, config, part.anchor, part.residual, where, head_dim)
            for part, where in zip(parts, wheres, strict=True)
        ]
    for part in parts:
        layout = part_layout(slots.numel(), part.rows.shape[1], part.kind, config, part.rows.dtype)
        reference.check_buffer(part.anchor, layout.anchor_nbytes, "anchor")
        reference.check_buffer(part.residual, layout.residual_nbytes, "residual")
    used = cpp_backend.encode_parts(parts, slots, config)
    for index, (part, where) in enumerate(zip(parts, wheres, strict=True)):
        if used[index] < 0:  # the reference zeroes this part's buffers and raises its located error
            part_rows = part.rows.index_select(0, slots)
            reference.encode_part(
                part_rows, part.kind, config, part.anchor, part.residual, where, slots, head_dim
            )
    return used


def decode_parts(
    parts: Sequence[PartIO], slots: torch.Tensor, config: CodecConfig, wheres: Sequence[str]
) -> None:
    """``decode_rows`` of several validated parts (``wheres`` name them in errors); the C++
    codec runs them all in one parallel region and writes no row if a lossless Residual is
    corrupt."""
    if parts and _use_cpp(parts[0].rows) and all(part.rows.is_contiguous() for part in parts):
        _raise_residual_faults(cpp_backend.decode_parts(parts, slots, config), wheres)
        return
    lossless_residual = bool(parts) and parts[0].residual is not None and config.residual_is_variable
    if lossless_residual and _lossless_on_device(parts[0].rows):
        from . import lossless_cuda

        dtype = parts[0].rows.dtype
        decoded = lossless_cuda.decode_bodies(
            [
                lossless_cuda.LosslessPart(part.anchor, part.kind, (slots.numel(), part.rows.shape[1]))
                for part in parts
            ],
            [part.residual for part in parts],  # type: ignore[misc]
            dtype,
            config,
            wheres,
        )
        for part, values in zip(parts, decoded, strict=True):
            part.rows.index_copy_(0, slots, values)
        return
    if not lossless_residual:
        for part in parts:
            decode_rows(part.anchor, part.residual, part.rows, slots, part.kind, config)
        return
    decoded = []  # every lossless part is decoded (and found sound) before any row is written
    for part, where in zip(parts, wheres, strict=True):
        try:
            decoded.append(
                _decoded_part(
                    part.anchor,
                    part.residual,
                    slots.numel(),
                    part.rows.shape[1],
                    part.rows.dtype,
                    part.kind,
                    config,
                )
            )
        except CodecInputError as exc:
            raise CodecInputError(f"{exc} (in {where})") from exc
    for part, values in zip(parts, decoded, strict=True):
        part.rows.index_copy_(0, slots, values.to(part.rows.device))


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
    check_parts_buffers([(anchor, residual, kind, where)], n, channels, config, dtype)


def check_parts_buffers(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor | None, Kind, str]],
    n: int,
    channels: int,
    config: CodecConfig,
    dtype: torch.dtype,
) -> None:
    """``check_part_buffers`` of several parts of ``n`` tokens, each (anchor, residual,
    kind, where); the anchors' parameters all at once (one synchronisation on a device)."""
    layouts = []
    for anchor, residual, kind, where in parts:
        layout = part_layout(n, channels, kind, config, dtype)
        reference.check_buffer(anchor, layout.anchor_nbytes, f"anchor {where}")
        if residual is not None and config.residual_is_variable:
            reference.check_buffer(residual, residual.numel(), f"residual {where}")
            if not 1 <= residual.numel() <= layout.residual_nbytes:
                raise CodecInputError(
                    f"corrupt lossless residual {where}: a part body of {residual.numel()} bytes, "
                    f"it must have 1..{layout.residual_nbytes}"
                )
        elif residual is not None:
            reference.check_buffer(residual, layout.residual_nbytes, f"residual {where}")
        layouts.append(layout)
    anchors = [anchor for anchor, *_ in parts]
    if parts and _use_cpp(anchors[0]):
        faults = [
            cpp_backend.anchor_params_fault(a, lay, dtype) for a, lay in zip(anchors, layouts, strict=True)
        ]
    else:
        faults = reference.anchor_params_faults(anchors, layouts, dtype) if parts else []
    for fault, (*_, where) in zip(faults, parts, strict=True):
        reference.raise_anchor_fault(fault, where)
