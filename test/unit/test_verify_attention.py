"""The verify pass's one-call attention against the row-by-row reference."""

from __future__ import annotations

import pytest
import torch

from lynx.verify.attention import attend_held_rows, attend_rows_reference, held_row_runs


def _case(dtype: torch.dtype, first_len: int, k: int, heads: int = 6, kv_heads: int = 2, dim: int = 16):
    g = torch.Generator().manual_seed(first_len * 31 + k)
    pool = first_len + k + 40
    k_cache = torch.randn(pool, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(pool, kv_heads, dim, generator=g).to(dtype)
    slots = torch.randperm(pool, generator=g)[: first_len + k - 1]
    query = torch.randn(k, heads, dim, generator=g).to(dtype)
    return query, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("first_len,k", [(1, 1), (1, 5), (37, 8), (700, 32)])
def test_one_call_equals_row_by_row(dtype: torch.dtype, atol: float, first_len: int, k: int) -> None:
    query, k_cache, v_cache, slots = _case(dtype, first_len, k)
    fast = attend_held_rows(query, k_cache, v_cache, slots, first_len, 0.25, True)
    ref = attend_rows_reference(query, k_cache, v_cache, slots, first_len, 0.25, True)
    assert fast.shape == ref.shape == (k, 6, 16)
    torch.testing.assert_close(fast.float(), ref.float(), atol=atol, rtol=0)


def test_row_i_ignores_later_keys() -> None:
    """Row i must not see slots past its own position: poisoning them changes nothing."""
    query, k_cache, v_cache, slots = _case(torch.float32, 20, 6)
    before = attend_held_rows(query, k_cache, v_cache, slots, 20, None, True)
    k_cache[slots[-1]] = 1e4
    v_cache[slots[-1]] = 1e4
    after = attend_held_rows(query, k_cache, v_cache, slots, 20, None, True)
    torch.testing.assert_close(after[:-1], before[:-1])
    assert not torch.allclose(after[-1], before[-1])


def test_cache_dtype_is_cast_to_the_query_dtype() -> None:
    query, k_cache, v_cache, slots = _case(torch.float32, 9, 3)
    out = attend_held_rows(query.bfloat16(), k_cache, v_cache, slots, 9, None, True)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "bad", [dict(slots=torch.arange(5)), dict(first_len=0), dict(query=torch.zeros(3, 6))]
)
def test_inconsistent_shapes_raise(bad: dict) -> None:
    query, k_cache, v_cache, slots = _case(torch.float32, 9, 3)
    args = dict(query=query, slots=slots, first_len=9) | bad
    with pytest.raises(ValueError):
        attend_held_rows(args["query"], k_cache, v_cache, args["slots"], args["first_len"], None, True)


def test_runs_split_rows_by_request_and_position() -> None:
    # Two verified requests (rows 4 and 9), a plain decode row, a request fed twice at the
    # same position (not consecutive: two runs).
    pool = [4, 4, 4, 7, 9, 9, 3, 3]
    lens = [10, 11, 12, 50, 20, 21, 8, 8]
    assert held_row_runs(pool, lens) == [(0, 3), (3, 4), (4, 6), (6, 7), (7, 8)]


def test_plain_decode_batch_is_all_single_rows() -> None:
    assert held_row_runs([1, 2, 3], [9, 9, 9]) == [(0, 1), (1, 2), (2, 3)]
    assert held_row_runs([], []) == []
    with pytest.raises(ValueError):
        held_row_runs([1], [])
