"""Attention for a verify pass: the held tokens of one request attend in one call.

A verify pass feeds a request's k held tokens as k decode rows; row i sits at position
``first_len - 1 + i`` and attends to the request's KV slots ``0 .. first_len - 1 + i``.
A decode backend that attends row by row (SGLang's CPU backend runs one SDPA call per
row and layer) makes the pass cost ~k decode steps of attention. The k rows of one
request share their keys, so one masked call over the longest row's keys computes the
same attention: row i's mask admits exactly its own prefix.

:func:`attend_rows_reference` is the row-by-row computation (the decode backend's);
:func:`attend_held_rows` the one-call fast path. They agree to floating-point rounding,
not bit for bit (the kernel reduces a masked block in a different order);
``docs/speculative.md`` says what that means for exactness and how it was measured.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def _check(query: torch.Tensor, slots: torch.Tensor, first_len: int) -> int:
    k = query.shape[0]
    if query.dim() != 3 or k < 1:
        raise ValueError(f"query must be (rows, heads, head_dim), got {tuple(query.shape)}")
    if first_len < 1 or slots.dim() != 1 or slots.shape[0] != first_len + k - 1:
        raise ValueError(
            f"{k} rows from a first row of {first_len} keys need {first_len + k - 1} KV "
            f"slots, got {tuple(slots.shape)}"
        )
    return k


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(0, 1).unsqueeze(0)


def attend_held_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    first_len: int,
    scaling: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """Attention of ``query`` (k, heads, head_dim), row i over the KV at
    ``slots[: first_len + i]``, in one masked call; returns (k, heads, v_head_dim)."""
    k = _check(query, slots, first_len)
    keys = k_cache[slots]
    values = v_cache[slots]
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    mask = torch.ones(k, slots.shape[0], dtype=torch.bool, device=query.device).tril(first_len - 1)
    out = scaled_dot_product_attention(
        _heads_first(query),
        _heads_first(keys),
        _heads_first(values),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=enable_gqa,
    )
    return out.squeeze(0).movedim(1, 0)


def attend_rows_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    first_len: int,
    scaling: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """The same attention one row at a time, as a decode backend computes it."""
    k = _check(query, slots, first_len)
    rows = []
    for i in range(k):
        prefix = slots[: first_len + i]
        keys, values = k_cache[prefix], v_cache[prefix]
        if keys.dtype != query.dtype:
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        out = scaled_dot_product_attention(
            _heads_first(query[i : i + 1]),
            _heads_first(keys),
            _heads_first(values),
            scale=scaling,
            enable_gqa=enable_gqa,
        )
        rows.append(out.squeeze(0).movedim(1, 0))
    return torch.cat(rows)


def held_row_runs(pool_rows: list[int], seq_lens: list[int]) -> list[tuple[int, int]]:
    """Split a decode batch's rows into maximal runs ``[start, end)`` of rows of one
    request at consecutive positions (same request row, each one key longer than the
    last). A plain decode batch has one row per request, so every run has one row; a
    verify pass has one run per request."""
    if len(pool_rows) != len(seq_lens):
        raise ValueError(f"{len(pool_rows)} request rows for {len(seq_lens)} sequence lengths")
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(pool_rows) + 1):
        if i == len(pool_rows) or pool_rows[i] != pool_rows[i - 1] or seq_lens[i] != seq_lens[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs
