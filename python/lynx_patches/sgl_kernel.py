"""Pure-torch stand-ins for the two ``sgl_kernel`` ops SGLang's CPU engine calls.

Upstream targets (module ``sgl_kernel``, package ``sglang-kernel``):
* ``sgl_kernel.assign_req_to_token_pool_cpu`` -- imported by ``sglang.srt.mem_cache.allocation``.
* ``sgl_kernel.copy_all_layer_kv_cache_cpu`` -- imported by ``sglang.kernels.ops.kvcache.cache_move``.

No CPU build of ``sgl_kernel`` is on the package index, and the CUDA wheel cannot be
imported without ``libcuda.so.1``; both importing modules do so at import time when the
CPU engine is on, so SGLang cannot start.  The hook registry cannot help: spawned
scheduler processes import those modules while unpickling their entry point, before
``load_plugins()`` runs.  So :func:`install` puts a stand-in package first on the import
path of this process and, through ``PYTHONPATH``, of every subprocess it starts.  It does
so only when the real ``sgl_kernel`` fails to import.

Upstream binds many more ``*_cpu`` ops at import time on the CPU engine (speculative
trees, MoE, MLA...) without calling them for a plain attention model; the stand-in
gives those names a function that raises :class:`CpuKernelUnavailable` when called,
so a model that needs one fails loudly and by name instead of at import.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

logger = logging.getLogger(__name__)

SHIM_ROOT = Path(__file__).resolve().parent / "_cpu_shims"


class CpuKernelUnavailable(NotImplementedError):
    """An ``sgl_kernel`` op was called that has no CPU stand-in."""


def unavailable_op(name: str) -> Callable[..., NoReturn]:
    def op(*_args: object, **_kwargs: object) -> NoReturn:
        raise CpuKernelUnavailable(
            f"sgl_kernel.{name} has no CPU implementation: no CPU build of sgl_kernel exists "
            "and Lynx stands in only for assign_req_to_token_pool_cpu and "
            "copy_all_layer_kv_cache_cpu (enough for attention-only models on the CPU engine)"
        )

    op.__name__ = name
    return op


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[row_i, start_i:end_i] = `` the next ``end_i - start_i`` slots, in order."""
    del pool_len  # the row length; implied by req_to_token's shape
    lengths = (end_offset - start_offset).to(torch.long)
    total = int(lengths.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.long), lengths)
    run_starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    cols = (
        torch.repeat_interleave(start_offset.to(torch.long), lengths)
        + torch.arange(total, dtype=torch.long)
        - run_starts
    )
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer ``b``: row ``tgt_loc[i]`` := row ``src_loc[i]``, rows of ``strides[b]`` bytes.

    Sources are gathered before any target is written, so overlapping moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.long)
    src = src_loc.to(torch.long)
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        table = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        table[tgt] = table[src]


def _real_sgl_kernel_imports() -> bool:
    try:
        module = importlib.import_module("sgl_kernel")
    except ImportError as exc:
        logger.info("sgl_kernel unavailable (%s); using Lynx's CPU stand-ins", exc)
        return False
    return not getattr(module, "LYNX_STAND_IN", False)


def install() -> None:
    """Serve ``import sgl_kernel`` from the stand-in here and in future subprocesses."""
    if _real_sgl_kernel_imports():
        return
    sys.modules.pop("sgl_kernel", None)
    root = str(SHIM_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
    importlib.import_module("sgl_kernel")
