"""Tensor-level API: encode one tensor into an Anchor and a Residual, and decode it back.

``kind="value"`` groups ``group_size`` consecutive values along the last dimension.
``kind="key"`` treats dim 0 as tokens and the remaining dims as channels: with the
default ``key_layout="per_channel"`` each channel is grouped over ``key_block``
consecutive tokens (the bytes are exactly those of one key part of a segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import backend
from .format import KV_DTYPES, CodecConfig, CodecInputError, Kind, part_layout


@dataclass(frozen=True)
class Encoded:
    """The two halves of an encoded tensor, each a contiguous 1-D uint8 tensor (a lossless
    Residual is as long as it coded)."""

    anchor: torch.Tensor
    residual: torch.Tensor


def _as_part(shape: tuple[int, ...], kind: Kind, config: CodecConfig) -> tuple[int, int]:
    """(n, C) of the part matrix a tensor of ``shape`` is encoded as."""
    if kind not in ("key", "value"):
        raise CodecInputError(f"kind must be 'key' or 'value', got {kind!r}")
    if len(shape) < (2 if kind == "key" else 1) or 0 in shape:
        raise CodecInputError(f"cannot encode a tensor of shape {tuple(shape)} as {kind}s")
    per_token = kind == "value" or config.key_layout == "per_token"
    if per_token and shape[-1] % config.group_size:
        raise CodecInputError(
            f"last dimension {shape[-1]} is not a multiple of group_size {config.group_size}"
        )
    if kind == "value":
        return (int(torch.Size(shape).numel()) // shape[-1], shape[-1])
    channels = int(torch.Size(shape[1:]).numel())
    if channels % 8:
        raise CodecInputError(f"keys need a multiple of 8 channels per token, got {channels}")
    return (shape[0], channels)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in KV_DTYPES:
        raise CodecInputError(f"dtype must be one of {KV_DTYPES}, got {dtype}")


def encode(x: torch.Tensor, config: CodecConfig, *, kind: Kind = "value") -> Encoded:
    """Encode ``x`` (bf16/fp16/fp32); raises CodecInputError on NaN/Inf or odd shapes."""
    _check_dtype(x.dtype)
    n, channels = _as_part(tuple(x.shape), kind, config)
    layout = part_layout(n, channels, kind, config, x.dtype)
    anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8, device=x.device)
    residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8, device=x.device)
    used = backend.encode_rows(x.reshape(n, channels).contiguous(), None, kind, config, anchor, residual)
    return Encoded(anchor=anchor, residual=residual[:used])


def decode(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    config: CodecConfig,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    kind: Kind = "value",
) -> torch.Tensor:
    """Reconstruct a tensor of ``shape``; ``residual=None`` gives the Anchor-only values."""
    _check_dtype(dtype)
    n, channels = _as_part(tuple(shape), kind, config)
    backend.check_part_buffers(anchor, residual, n, channels, kind, config, dtype, kind + "s")
    out = torch.empty((n, channels), dtype=dtype, device=anchor.device)
    backend.decode_rows(anchor, residual, out, None, kind, config)
    return out.view(tuple(shape))
