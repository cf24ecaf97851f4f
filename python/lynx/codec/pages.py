"""Page-level codec for an SGLang-style KV pool: per layer ``k_buffers[l]`` and
``v_buffers[l]`` of shape (rows, num_kv_heads, head_dim), row index = token slot.

A request's tokens travel in segments; a segment is an int64 tensor of token slots (any
rows, in token order). Its Anchor and Residual are written straight into caller-owned
uint8 buffers (views into a registered staging region) of the sizes ``segment_nbytes``
gives, and decoded straight back into the pool rows. The byte layout is in format.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from . import backend
from .cpp_backend import PartIO
from .format import (
    CodecConfig,
    CodecInputError,
    Kind,
    KVLayout,
    check_layout,
    part_layout,
    segment_nbytes,
)

_KINDS: tuple[Kind, Kind] = ("key", "value")


def kv_layout_of(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]) -> KVLayout:
    """The KVLayout of a pool, after checking every layer buffer agrees with it."""
    if len(k_buffers) != len(v_buffers) or not k_buffers:
        raise CodecInputError(
            f"need as many V as K layer buffers, at least one: {len(k_buffers)} K, {len(v_buffers)} V"
        )
    first = k_buffers[0]
    if first.dim() != 3:
        raise CodecInputError(
            f"a KV layer buffer must be (rows, heads, head_dim), got shape {tuple(first.shape)}"
        )
    layout = KVLayout(len(k_buffers), first.shape[1], first.shape[2], first.dtype)
    for name, buffers in (("k", k_buffers), ("v", v_buffers)):
        for index, buf in enumerate(buffers):
            if (
                buf.shape != first.shape
                or buf.dtype != first.dtype
                or buf.device != first.device
                or not buf.is_contiguous()
            ):
                raise CodecInputError(
                    f"{name}_buffers[{index}] is {tuple(buf.shape)} {buf.dtype} on {buf.device}"
                    f"{'' if buf.is_contiguous() else ' (not contiguous)'}; expected contiguous "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}"
                )
    return layout


def _check_slots(slots: torch.Tensor, rows: int, device: torch.device) -> None:
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise CodecInputError(f"slots must be a 1-D int64 tensor, got {slots.dtype} {slots.dim()}-D")
    if slots.device != device:
        raise CodecInputError(f"slots are on {slots.device}, the KV pool on {device}")
    if slots.numel() and not (int(slots.min()) >= 0 and int(slots.max()) < rows):
        raise CodecInputError(f"slots must lie in 0..{rows - 1}, got {int(slots.min())}..{int(slots.max())}")


def _parts(layout: KVLayout, n: int, config: CodecConfig) -> Iterator[tuple[int, Kind, slice, slice]]:
    """(layer, kind, anchor byte range, residual byte range) of each part, in wire order."""
    anchor_at = residual_at = 0
    sizes = {kind: part_layout(n, layout.channels, kind, config, layout.dtype) for kind in _KINDS}
    for layer in range(layout.num_layers):
        for kind in _KINDS:
            part = sizes[kind]
            yield (
                layer,
                kind,
                slice(anchor_at, anchor_at + part.anchor_nbytes),
                slice(residual_at, residual_at + part.residual_nbytes),
            )
            anchor_at += part.anchor_nbytes
            residual_at += part.residual_nbytes


def _prepare(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
) -> KVLayout:
    layout = kv_layout_of(k_buffers, v_buffers)
    check_layout(layout, config)
    _check_slots(slots, k_buffers[0].shape[0], k_buffers[0].device)
    needed = segment_nbytes(layout, slots.numel(), config)
    for what, buf, nbytes in (("anchor", anchor, needed[0]), ("residual", residual, needed[1])):
        if buf is None:
            continue
        if buf.device != k_buffers[0].device:
            raise CodecInputError(f"{what} buffer is on {buf.device}, the KV pool on {k_buffers[0].device}")
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise CodecInputError(f"{what} buffer must be a contiguous 1-D uint8 tensor")
        if buf.numel() != nbytes:
            raise CodecInputError(
                f"{what} buffer has {buf.numel()} bytes, a segment of {slots.numel()} tokens needs {nbytes}"
            )
    return layout


def encode_pages(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor,
) -> None:
    """Encode the segment ``slots`` (all layers, K and V) into the two byte buffers.

    Raises CodecInputError, naming layer, kind, token and slot, on a non-finite value.
    """
    layout = _prepare(k_buffers, v_buffers, slots, config, anchor_out, residual_out)
    buffers = {"key": k_buffers, "value": v_buffers}
    parts, wheres = [], []
    for layer, kind, anchor_range, residual_range in _parts(layout, slots.numel(), config):
        rows = buffers[kind][layer].view(-1, layout.channels)
        parts.append(PartIO(rows, kind, anchor_out[anchor_range], residual_out[residual_range]))
        wheres.append(f"in layer {layer} {kind}s")
    backend.encode_parts(parts, wheres, slots, config, layout.head_dim)


def decode_pages(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
) -> None:
    """Write the segment's reconstruction into the pool rows ``slots`` in place.

    ``residual=None``: Anchor-only values; with the Residual: full precision (bit-exact
    with ``residual="exact"``). Everything is validated before the first row is written.
    """
    layout = _prepare(k_buffers, v_buffers, slots, config, anchor, residual)
    n = slots.numel()
    parts = list(_parts(layout, n, config))
    for layer, kind, anchor_range, residual_range in parts:
        backend.check_part_buffers(
            anchor[anchor_range],
            None if residual is None else residual[residual_range],
            n,
            layout.channels,
            kind,
            config,
            layout.dtype,
            f"layer {layer} {kind}s",
        )
    buffers = {"key": k_buffers, "value": v_buffers}
    backend.decode_parts(
        [
            PartIO(
                buffers[kind][layer].view(-1, layout.channels),
                kind,
                anchor[anchor_range],
                None if residual is None else residual[residual_range],
            )
            for layer, kind, anchor_range, residual_range in parts
        ],
        slots,
        config,
    )
