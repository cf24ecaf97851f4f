"""Page-level codec for an SGLang-style KV pool: per layer ``k_buffers[l]`` and
``v_buffers[l]`` of shape (rows, num_kv_heads, head_dim), row index = token slot.

A request's tokens travel in segments; a segment is an int64 tensor of token slots (any
rows, in token order). Its Anchor and Residual are written straight into caller-owned
uint8 buffers (views into a registered staging region) of the sizes ``segment_nbytes``
gives, and decoded straight back into the pool rows. The byte layout is in format.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch

from . import backend
from .cpp_backend import PartIO
from .format import (
    ALIGN,
    CodecConfig,
    CodecInputError,
    Kind,
    KVLayout,
    check_layout,
    part_layout,
    residual_header_nbytes,
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
    """(layer, kind, anchor byte range, residual byte range) of each part, in wire order; a
    variable-length Residual's ranges are its parts' capacities, after its head."""
    anchor_at = 0
    residual_at = residual_header_nbytes(layout) if config.residual_is_variable else 0
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
    *,
    read_slots: bool = True,
) -> KVLayout:
    """Check the pool, the slots (their range too, which reads them back, if
    ``read_slots``) and the buffers; returns the pool's layout."""
    layout = kv_layout_of(k_buffers, v_buffers)
    check_layout(layout, config)
    if read_slots:
        _check_slots(slots, k_buffers[0].shape[0], k_buffers[0].device)
    elif slots.dtype != torch.int64 or slots.dim() != 1 or slots.device != k_buffers[0].device:
        raise CodecInputError(f"slots must be a 1-D int64 tensor on {k_buffers[0].device}")
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


def _anchor_only(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    n_tokens: int,
    config: CodecConfig,
    device: torch.device,
) -> tuple[CodecConfig, torch.Tensor]:
    """For an Anchor coded alone: the cheapest config with the same Anchor (every residual
    mode has it), and scratch space for the Residual it also writes."""
    anchor_only = dataclasses.replace(config, residual="int8")
    nbytes = segment_nbytes(kv_layout_of(k_buffers, v_buffers), n_tokens, anchor_only)[1]
    return anchor_only, torch.empty(nbytes, dtype=torch.uint8, device=device)


def encode_pages(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> int:
    """Encode the segment ``slots`` (all layers, K and V) into the two byte buffers;
    returns how many bytes of ``residual_out`` the Residual takes (all of them unless
    ``config.residual_is_variable``; the rest is zero) and so travel. ``residual_out``
    None: the Anchor alone, for a Residual that will not travel (returns 0).

    Raises CodecInputError, naming layer, kind, token and slot, on a non-finite value.
    """
    if residual_out is None:
        anchor_only, scratch = _anchor_only(k_buffers, v_buffers, slots.numel(), config, anchor_out.device)
        encode_pages(k_buffers, v_buffers, slots, anchor_only, anchor_out, scratch)
        return 0
    layout = _prepare(k_buffers, v_buffers, slots, config, anchor_out, residual_out)
    if not slots.numel():
        return 0  # an empty segment: both halves are empty
    buffers = {"key": k_buffers, "value": v_buffers}
    parts, wheres, ranges = [], [], []
    for layer, kind, anchor_range, residual_range in _parts(layout, slots.numel(), config):
        rows = buffers[kind][layer].view(-1, layout.channels)
        parts.append(PartIO(rows, kind, anchor_out[anchor_range], residual_out[residual_range]))
        wheres.append(f"in layer {layer} {kind}s")
        ranges.append(residual_range)
    used = backend.encode_parts(parts, wheres, slots, config, layout.head_dim)
    if not config.residual_is_variable:
        return residual_out.numel()
    return _compact_residual(residual_out, [r.start for r in ranges], used, residual_header_nbytes(layout))


def enqueue_anchor_pages(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    anchor_out: torch.Tensor,
) -> None:
    """The Anchor of ``encode_pages`` for a CUDA pool, enqueued on the current stream
    (after the KV writes enqueued there) and not waited for: nothing is read back, so no
    value is checked (a non-finite one makes a meaningless Anchor, not an error), and
    ``slots`` must be known to lie in the pool. For a caller that encodes the same KV again,
    checked, before anything it sent is used: the sender's layer-by-layer Anchors, held to
    their chunk's encode. Raises CodecInputError for a CPU pool or buffers that do not fit."""
    if not backend._use_triton(anchor_out):
        raise CodecInputError(f"enqueue_anchor_pages codes a CUDA pool, not one on {anchor_out.device}")
    anchor_only, scratch = _anchor_only(k_buffers, v_buffers, slots.numel(), config, anchor_out.device)
    layout = _prepare(k_buffers, v_buffers, slots, anchor_only, anchor_out, scratch, read_slots=False)
    if not slots.numel():
        return
    buffers = {"key": k_buffers, "value": v_buffers}
    parts = [
        PartIO(buffers[kind][layer].view(-1, layout.channels), kind, anchor_out[anchors], scratch[residuals])
        for layer, kind, anchors, residuals in _parts(layout, slots.numel(), anchor_only)
    ]
    backend.enqueue_parts_on_device(parts, slots, anchor_only)


def _compact_residual(residual: torch.Tensor, starts: list[int], lengths: list[int], head: int) -> int:
    """Move the part bodies (``lengths`` bytes at ``starts``, in order, each start at or
    after the previous body's new end) back to back after the head, write the head and
    zero the rest up to a multiple of ALIGN; returns that length."""
    bodies = torch.cat(
        [residual[start : start + length] for start, length in zip(starts, lengths, strict=True)]
    )
    at = head + bodies.numel()
    residual[head:at] = bodies  # a copy: the bodies' sources overlap where they go
    ends = [head + int(end) for end in torch.tensor(lengths).cumsum(0)]
    used = -(-at // ALIGN) * ALIGN
    residual[at:].zero_()
    residual[:head] = torch.tensor([used, *ends], dtype=torch.int32).view(torch.uint8).to(residual.device)
    return used


def residual_nbytes_of(residual: torch.Tensor, n_tokens: int, layout: KVLayout, config: CodecConfig) -> int:
    """How many bytes of a segment's Residual travel, read from its head when its length
    varies (``residual`` is the segment's whole Residual space, ``segment_nbytes`` long).
    CodecInputError if that head is not a possible one."""
    capacity = segment_nbytes(layout, n_tokens, config)[1]
    if not config.residual_is_variable:
        return capacity
    used, _ = _residual_head(residual, n_tokens, layout, config)
    return used


def residual_layer_ends(
    residual: torch.Tensor, n_tokens: int, layout: KVLayout, config: CodecConfig
) -> list[int]:
    """Where each layer's bytes of a segment's encoded Residual end (``residual`` is its
    whole Residual space): layer ``l`` takes ``[ends[l - 1], ends[l])`` (layer 0 from byte
    0, its head included), and the last layer ends where the Residual's travelling bytes
    do (``residual_nbytes_of``), its padding included. So a landed prefix of layers can be
    decoded on its own (``decode_pages(..., layers=...)``). CodecInputError if a
    variable-length Residual's head is not a possible one."""
    if not config.residual_is_variable:
        return [
            residual_range.stop
            for _, kind, _, residual_range in _parts(layout, n_tokens, config)
            if kind == "value"
        ]
    used, ends = _residual_head(residual, n_tokens, layout, config)
    return [*ends[1:-1:2], used]


def _residual_head(
    residual: torch.Tensor, n_tokens: int, layout: KVLayout, config: CodecConfig
) -> tuple[int, list[int]]:
    """(length, part ends) from a variable-length segment Residual's head, checked against
    the segment's capacity and each part's."""
    capacity = segment_nbytes(layout, n_tokens, config)[1]
    head = residual_header_nbytes(layout)
    if residual.numel() < head:
        raise CodecInputError(f"a segment Residual of {residual.numel()} bytes is shorter than its head")
    values = [v & 0xFFFFFFFF for v in residual[:head].cpu().view(torch.int32).tolist()]
    used, ends = values[0], values[1:]
    if used % ALIGN or not head < used <= min(capacity, residual.numel()):
        raise CodecInputError(
            f"corrupt lossless residual: its head says {used} bytes, a segment of {n_tokens} tokens "
            f"has room for {capacity} (a multiple of {ALIGN} above {head})"
        )
    limits = [
        part_layout(n_tokens, layout.channels, kind, config, layout.dtype).residual_nbytes for kind in _KINDS
    ]
    start = head
    for index, end in enumerate(ends):
        if not start < end <= min(used, start + limits[index % 2]):
            raise CodecInputError(
                f"corrupt lossless residual: part {index} of the segment ends at byte {end}, "
                f"after byte {start} and within {min(used, start + limits[index % 2])} expected"
            )
        start = end
    return used, ends


def check_pages(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    layers: range | None = None,
) -> None:
    """What :func:`decode_pages` checks before it writes a row (sizes, every group's
    minimum and scale of ``layers``, a lossless Residual's head), writing nothing: a caller
    decoding a request's segments checks them all before it writes any."""
    _checked_parts(anchor, residual, k_buffers, v_buffers, slots, config, layers)


def decode_pages(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    layers: range | None = None,
) -> None:
    """Write the segment's reconstruction into the pool rows ``slots`` in place: of every
    layer, or of ``layers`` only (the others' rows are not touched; a Residual needs only
    its bytes up to those layers' end, ``residual_layer_ends``, and its head).

    ``residual=None``: Anchor-only values; with the Residual (the segment's whole Residual
    space, ``segment_nbytes`` long): full precision, bit-exact with ``residual="exact"``.
    Everything is validated before the first row is written: sizes and parameters first
    (:func:`check_pages`), a lossless Residual's every part as it decodes.
    """
    layout, parts = _checked_parts(anchor, residual, k_buffers, v_buffers, slots, config, layers)
    if not parts:
        return
    buffers = {"key": k_buffers, "value": v_buffers}
    backend.decode_parts(
        [
            PartIO(buffers[kind][layer].view(-1, layout.channels), kind, part_anchor, body)
            for layer, kind, part_anchor, body, _ in parts
        ],
        slots,
        config,
        [where for *_, where in parts],
    )


def _checked_parts(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor],
    slots: torch.Tensor,
    config: CodecConfig,
    layers: range | None = None,
) -> tuple[KVLayout, list[tuple[int, Kind, torch.Tensor, torch.Tensor | None, str]]]:
    """The pool's layout and each part's (layer, kind, Anchor bytes, Residual body, name)
    of ``layers`` (None: all), after checking everything that can be checked before
    decoding (a lossless Residual's whole head); no parts if no slots."""
    layout = _prepare(k_buffers, v_buffers, slots, config, anchor, residual)
    if layers is not None and not (
        0 <= layers.start <= layers.stop <= layout.num_layers and layers.step == 1
    ):
        raise CodecInputError(f"layers {layers} of a pool of {layout.num_layers}")
    n = slots.numel()
    parts = list(_parts(layout, n, config))
    if not n:
        return layout, []
    bodies: list[torch.Tensor | None] = [None if residual is None else residual[r] for _, _, _, r in parts]
    if residual is not None and config.residual_is_variable:
        _, ends = _residual_head(residual, n, layout, config)
        starts = [residual_header_nbytes(layout), *ends[:-1]]
        bodies = [residual[start:end] for start, end in zip(starts, ends, strict=True)]
    checked = [
        (layer, kind, anchor[anchor_range], body, f"layer {layer} {kind}s")
        for (layer, kind, anchor_range, _), body in zip(parts, bodies, strict=True)
        if layers is None or layer in layers
    ]
    backend.check_parts_buffers(
        [(part_anchor, body, kind, where) for _, kind, part_anchor, body, where in checked],
        n,
        layout.channels,
        config,
        layout.dtype,
    )
    return layout, checked
