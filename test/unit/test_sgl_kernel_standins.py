"""The pure-torch stand-ins for sgl_kernel's CPU ops against plain-loop references."""

import pytest
import torch

from lynx_patches.sgl_kernel import (
    CpuKernelUnavailable,
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
    unavailable_op,
)


def test_assign_req_to_token_pool_matches_a_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(6, 40, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)
    start = torch.tensor([3, 0, 10], dtype=torch.int64)
    end = torch.tensor([9, 0, 25], dtype=torch.int64)
    total = int((end - start).sum())
    out_cache_loc = torch.randint(1, 1000, (total + 5,), generator=gen, dtype=torch.int64)

    expected = req_to_token.clone()
    offset = 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist(), strict=True):
        expected[r, s:e] = out_cache_loc[offset : offset + e - s].to(torch.int32)
        offset += e - s

    assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out_cache_loc, req_to_token.shape[1])
    assert torch.equal(req_to_token, expected)


def test_copy_all_layer_kv_cache_moves_rows_of_every_buffer_even_when_overlapping() -> None:
    buffers = [torch.arange(12 * 8, dtype=torch.float32).view(12, 8) * (i + 1) for i in range(3)]
    buffers.append(torch.arange(12 * 3, dtype=torch.int16).view(12, 3))
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers], dtype=torch.int64)
    src = torch.tensor([1, 2, 3, 7], dtype=torch.int64)
    tgt = torch.tensor([2, 3, 4, 0], dtype=torch.int64)  # overlaps its own sources
    expected = [b.clone() for b in buffers]
    for e in expected:
        e[tgt] = e[src].clone()

    copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got, want)


def test_other_ops_fail_by_name_when_called() -> None:
    op = unavailable_op("fused_experts_cpu")
    with pytest.raises(CpuKernelUnavailable, match="fused_experts_cpu"):
        op(torch.zeros(1))
