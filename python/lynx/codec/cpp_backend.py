"""The fused C++ CPU codec (``csrc/cpu_codec.cpp``): compiled with
``torch.utils.cpp_extension.load`` at first use (cached under
``$TORCH_EXTENSIONS_DIR/lynx/``, default ``~/.cache/torch_extensions/lynx/``; a cached
build is imported directly), one pass per part, the same bytes as ``reference.py``.

``-ffp-contract=off`` and no ``-ffast-math``: every float32 operation rounds as torch's.
``-march=native``: the build is for the host it runs on (the cache is per host); it needs
AVX2, FMA, F16C and BMI2 (x86-64 since Haswell) and fails to build elsewhere, where the
reference is used.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from .format import CodecConfig, Kind, PartLayout, part_layout

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "cpu_codec.cpp", _CSRC / "cpu_codec_kernels.h", _CSRC / "cpu_codec_lossless.h")
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]

log = logging.getLogger(__name__)


class NativeBuildError(RuntimeError):
    """The C++ codec could not be compiled or loaded on this host."""


def _build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "lynx" / name


def _import_built(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    return extension


@functools.cache
def _build() -> ModuleType | BaseException:
    from torch.utils import cpp_extension

    # The name carries a digest of the sources and flags: torch's build cache does not
    # track the header, and a stale build must never be loaded.
    digest = hashlib.sha256(" ".join(_CFLAGS).encode())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    name = f"lynx_cpu_codec_{digest.hexdigest()[:16]}"
    build_dir = _build_dir(name)
    library = build_dir / f"{name}.so"
    try:
        if library.exists():
            # Built before: import it, rather than have every server process take torch's
            # build lock and run ninja at start-up.
            return _import_built(name, library)
        build_dir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(_SOURCES[0])],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
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


class PartIO(NamedTuple):
    """One part of a call: its pool rows (read through the shared slots) and its byte ranges
    (``residual`` None: Anchor-only decode)."""

    rows: torch.Tensor
    kind: Kind
    anchor: torch.Tensor
    residual: torch.Tensor | None


def _geometry(parts: Sequence[PartIO], n: int, config: CodecConfig) -> tuple[list[bool], list[PartLayout]]:
    per_channel = [part.kind == "key" and config.key_layout == "per_channel" for part in parts]
    layouts = [part_layout(n, part.rows.shape[1], part.kind, config, part.rows.dtype) for part in parts]
    return per_channel, layouts


RESIDUAL_FAULTS = (
    "",
    "a part body of another length than its content",
    "an unknown part format",
    "its code tables are out of order, out of range or not complete codes",
    "a value whose context has no code table",
    "a code that is in no table",
    "a value decodes out of the word range",
    "it decodes to a NaN or infinite word",
    "bits set past the last value",
)
"""What decode_parts' per-part fault code (an index, ``ResidualFault`` in the C++) means."""


def encode_parts(parts: Sequence[PartIO], slots: torch.Tensor | None, config: CodecConfig) -> list[int]:
    """Encode each part's ``rows[slots]`` into its buffers, all in one parallel region; per
    part, the Residual bytes written, or -1 if its input was not finite (its buffers then
    hold garbage: the caller raises)."""
    n = parts[0].rows.shape[0] if slots is None else slots.numel()
    per_channel, layouts = _geometry(parts, n, config)
    return module().encode_rows(
        [part.rows for part in parts],
        None if slots is None else slots.contiguous(),
        per_channel,
        config.group_size,
        config.key_block,
        config.anchor_bits,
        config.residual == "exact",
        [layout.param_nbytes for layout in layouts],
        [layout.scales_offset for layout in layouts],
        [layout.codes_offset for layout in layouts],
        [part.anchor for part in parts],
        [part.residual for part in parts],
        torch.get_num_threads(),
    )


def decode_parts(parts: Sequence[PartIO], slots: torch.Tensor | None, config: CodecConfig) -> list[int]:
    """Decode validated parts into their ``rows[slots]`` in place, in one parallel region
    (all with a residual or all without); per part an index into RESIDUAL_FAULTS (a
    lossless Residual's rows are written only when every part is sound)."""
    n = parts[0].rows.shape[0] if slots is None else slots.numel()
    per_channel, layouts = _geometry(parts, n, config)
    residuals = [part.residual for part in parts]
    return module().decode_rows(
        [part.anchor for part in parts],
        None if residuals[0] is None else residuals,
        [part.rows for part in parts],
        None if slots is None else slots.contiguous(),
        per_channel,
        config.group_size,
        config.key_block,
        config.anchor_bits,
        config.residual == "exact",
        [layout.scales_offset for layout in layouts],
        [layout.codes_offset for layout in layouts],
        torch.get_num_threads(),
    )


def anchor_params_fault(anchor: torch.Tensor, layout: PartLayout, dtype: torch.dtype) -> int:
    """``reference.anchor_params_fault`` in one pass over the parameter words."""
    return module().anchor_params_fault(
        anchor, torch.empty(0, dtype=dtype), layout.num_groups, layout.scales_offset
    )
