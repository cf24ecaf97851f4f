"""The fused C++ CPU codec (``csrc/cpu_codec.cpp``), one pass per part, the same bytes as
``reference.py``. It is compiled into the package as ``lynx.codec._cpu_codec`` when the package
is built or installed (``setup.py``, flags in ``cpp_build.py``); nothing compiles at run time.

It is used only where it was built from the sources and flags installed next to it (an
editable install's in-place build goes stale when the sources change) and on a CPU with
what it was compiled for (x86-64-v3); elsewhere one warning says why and how to build it,
and the torch reference serves.
"""

from __future__ import annotations

import functools
import importlib
import logging
import platform
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch

from . import cpp_build, lossless
from .format import CodecConfig, Kind, PartLayout, part_layout

log = logging.getLogger(__name__)

HOW_TO_BUILD = (
    "scripts/install.sh, or pip install --no-deps --no-build-isolation -e . in a checkout, compiles it "
    "(x86-64 and a C++ compiler)"
)

# Measured on the 2-core dev host (256 tokens of SmolLM2's KV, 2 threads; docs/codec.md).
COST = (
    "with the default lossless Residual about 70x slower to encode and 1,500x slower to decode "
    "(0.008 and 0.0004 GB/s against 0.53 and 0.65), 13x and 8x with --lynx-residual int8"
)


class NativeBuildError(RuntimeError):
    """The compiled C++ codec is missing, stale or not for this CPU."""


def cpu_lacks() -> list[str]:
    """The x86-64-v3 features this CPU lacks (none known where there is no /proc/cpuinfo)."""
    if platform.machine() != "x86_64":
        return []  # nothing was built for it: the import says so
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return [flag for flag in cpp_build.CPU_FLAGS if flag not in flags]


def _import_checked() -> ModuleType:
    lacking = cpu_lacks()
    if lacking:
        raise NativeBuildError(f"the C++ CPU codec needs {', '.join(lacking)}, which this CPU lacks")
    try:
        extension = importlib.import_module(cpp_build.MODULE)
    except ImportError as err:
        raise NativeBuildError(f"the C++ CPU codec is not built ({err}); {HOW_TO_BUILD}") from err
    if extension.source_digest != cpp_build.source_digest():
        raise NativeBuildError(
            f"the C++ CPU codec was built from other sources or flags than those installed "
            f"(a stale build); {HOW_TO_BUILD}"
        )
    return extension


@functools.cache
def _load() -> ModuleType | NativeBuildError:
    try:
        return _import_checked()
    except NativeBuildError as err:
        log.warning(
            "Lynx: %s. CPU encoding and decoding run the torch reference codec instead: %s.", err, COST
        )
        return err


def module() -> ModuleType:
    """The compiled extension; raises NativeBuildError (once logged) where it cannot be used."""
    loaded = _load()
    if isinstance(loaded, NativeBuildError):
        raise NativeBuildError(str(loaded)) from loaded
    return loaded


def available() -> bool:
    """Whether the compiled extension loads here (logs why not, once)."""
    return not isinstance(_load(), NativeBuildError)


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
    "a block's values take other bits than its count in the block table",
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
    """``reference.anchor_params_faults`` of one part, in one pass over the parameter words."""
    return module().anchor_params_fault(
        anchor, torch.empty(0, dtype=dtype), layout.num_groups, layout.scales_offset
    )


def huffman_codes(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Code lengths and canonical codes (``lossless.code_lengths``,
    ``lossless.canonical_codes``) of each row of ``counts`` (tables, symbols): compiled
    where the module loads, else those functions row by row."""
    if available():
        lengths, codes = module().huffman_codes(
            torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64))
        )
        return lengths.numpy().astype(np.int64), codes.numpy().astype(np.int64)
    lengths = np.array([lossless.code_lengths(row.tolist()) for row in counts], dtype=np.int64).reshape(
        counts.shape
    )
    codes = np.array([lossless.canonical_codes(row.tolist()) for row in lengths], dtype=np.int64).reshape(
        counts.shape
    )
    return lengths, codes
