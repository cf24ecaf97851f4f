"""The fused C++ CPU codec (``csrc/cpu_codec.cpp``): compiled with
``torch.utils.cpp_extension.load`` at first use (cached under ``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``), one pass per part, the same bytes as
``reference.py``.

``-ffp-contract=off`` and no ``-ffast-math``: every float32 operation rounds as torch's.
``-march=native``: the build is for the host it runs on (the cache is per host); it needs
BMI2 (x86-64 since Haswell) and fails to build elsewhere, where the reference is used.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

from .format import CodecConfig, Kind, PartLayout

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "cpu_codec.cpp", _CSRC / "cpu_codec_kernels.h")
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]

log = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """The C++ codec could not be compiled or loaded on this host."""


@functools.cache
def _build() -> ModuleType | BaseException:
    from torch.utils import cpp_extension

    # The name carries a digest of the sources and flags: torch's build cache does not
    # track the header, and a stale build must never be loaded.
    digest = hashlib.sha256(" ".join(_CFLAGS).encode())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    try:
        return cpp_extension.load(
            name=f"lynx_cpu_codec_{digest.hexdigest()[:16]}",
            sources=[str(_SOURCES[0])],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as err:  # a compiler or linker failure surfaces as several types
        log.warning("lynx C++ CPU codec did not build, using the torch reference: %s", err)
        return err


def module() -> ModuleType:
    """The compiled extension; raises NativeBuildError (once logged) when it cannot build."""
    built = _build()
    if isinstance(built, BaseException):
        raise NativeBuildError(f"the C++ CPU codec did not build: {built}") from built
    return built


def available() -> bool:
    """Whether the extension builds and loads here (builds it on the first call)."""
    return not isinstance(_build(), BaseException)


def _per_channel(kind: Kind, config: CodecConfig) -> bool:
    return kind == "key" and config.key_layout == "per_channel"


def encode_rows(
    rows: torch.Tensor,
    slots: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    layout: PartLayout,
    anchor_out: torch.Tensor,
    residual_out: torch.Tensor,
) -> bool:
    """Encode ``rows[slots]`` into the part's buffers; False when the input was not finite
    (the buffers then hold garbage: the caller raises)."""
    return module().encode_rows(
        rows,
        None if slots is None else slots.contiguous(),
        _per_channel(kind, config),
        config.group_size,
        config.key_block,
        config.anchor_bits,
        config.residual == "exact",
        layout.param_nbytes,
        layout.scales_offset,
        layout.codes_offset,
        anchor_out,
        residual_out,
        torch.get_num_threads(),
    )


def decode_rows(
    anchor: torch.Tensor,
    residual: torch.Tensor | None,
    rows: torch.Tensor,
    slots: torch.Tensor | None,
    kind: Kind,
    config: CodecConfig,
    layout: PartLayout,
) -> None:
    """Decode one validated part into ``rows[slots]`` in place (residual None: Anchor only)."""
    module().decode_rows(
        anchor,
        residual,
        rows,
        None if slots is None else slots.contiguous(),
        _per_channel(kind, config),
        config.group_size,
        config.key_block,
        config.anchor_bits,
        config.residual == "exact",
        layout.scales_offset,
        layout.codes_offset,
        torch.get_num_threads(),
    )


def anchor_params_fault(anchor: torch.Tensor, layout: PartLayout, dtype: torch.dtype) -> int:
    """``reference.anchor_params_fault`` in one pass over the parameter words."""
    return module().anchor_params_fault(
        anchor, torch.empty(0, dtype=dtype), layout.num_groups, layout.scales_offset
    )
