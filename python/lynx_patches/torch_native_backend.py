"""A batched verify pass's held rows attend in one call on SGLang's CPU attention backend
(``--lynx-mode speculative --lynx-verify-pass batched``).

Hook target (``sglang.srt.`` omitted):
* ``layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode``
  AROUND: upstream attends one decode row per SDPA call; a batched verify pass has k rows
  per request in one forward (:func:`lynx_patches.upstream.run_verify_forward`), so it
  would pay k calls per layer. Runs of rows of one request at consecutive positions
  (:func:`lynx.verify.attention.held_row_runs`) attend in one masked call
  (:func:`lynx.verify.attention.attend_held_rows`); every other row goes to upstream.
  A plain decode batch, and a verify pass in decode steps, has one row per request:
  upstream computes all of it, unchanged.

Contract: scheduler thread, inside a forward; writes only the output rows of the runs it
computes. Without a speculative decoder, with ``--lynx-verify-pass steps``, with
cross-attention, encoder lengths or a sliding window, upstream computes the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch

from lynx.verify.attention import attend_held_rows, held_row_runs
from lynx_patches import runtime
from lynx_patches._hooks import hook

TARGET = "layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode"


def _held_rows_together(
    original: Any,
    backend: Any,
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    encoder_lens: torch.Tensor | None = None,
    scaling: float | None = None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> torch.Tensor:
    def upstream_rows(start: int, end: int) -> None:
        original(
            backend,
            query[start:end],
            output[start:end],
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices[start:end],
            seq_lens[start:end],
            encoder_lens=None if encoder_lens is None else encoder_lens[start:end],
            scaling=scaling,
            enable_gqa=enable_gqa,
            causal=causal,
            is_cross_attn=is_cross_attn,
            sliding_window_size=sliding_window_size,
        )

    lynx = runtime.current()
    plain = (
        lynx is None
        or lynx.decoder is None
        or lynx.settings.verify_pass != "batched"
        or encoder_lens is not None
        or is_cross_attn
        or sliding_window_size is not None
        or query.shape[0] != seq_lens.shape[0]
    )
    runs = [] if plain else held_row_runs(req_pool_indices.tolist(), seq_lens.tolist())
    if all(end - start == 1 for start, end in runs):
        upstream_rows(0, query.shape[0])
        return output
    for start, end in runs:
        if end - start == 1:
            upstream_rows(start, end)
            continue
        first_len = int(seq_lens[start])
        slots = req_to_token[req_pool_indices[start], : first_len + end - start - 1]
        output[start:end] = attend_held_rows(
            query[start:end], k_cache, v_cache, slots, first_len, scaling, enable_gqa
        )
    return output


def register() -> None:
    hook(TARGET, _held_rows_together, "around")
