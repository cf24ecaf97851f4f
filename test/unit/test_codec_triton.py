"""The Triton kernels write the same bytes and values as the torch reference, bit for bit.

Without a GPU they run under the Triton interpreter (TRITON_INTERPRET=1, set here before
Triton is first imported); with one, on the GPU. Shapes stay small: the interpreter runs
every program instance in Python.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

from lynx.codec import CodecConfig, backend, triton_kernels  # noqa: E402
from lynx.codec.format import part_layout  # noqa: E402
from lynx.codec.reference import decode_part, encode_part, raise_non_finite  # noqa: E402

CASES = [
    (torch.bfloat16, "key", CodecConfig()),
    (torch.bfloat16, "value", CodecConfig()),
    (torch.float16, "key", CodecConfig(anchor_bits=3, group_size=16, key_block=4)),
    (torch.float16, "value", CodecConfig(anchor_bits=3, group_size=16)),
    (torch.float32, "key", CodecConfig(anchor_bits=2, key_layout="per_token", group_size=8)),
    (torch.float32, "value", CodecConfig(anchor_bits=2, residual="exact", group_size=8)),
    (torch.bfloat16, "key", CodecConfig(anchor_bits=2, residual="exact", key_block=8)),
]


def _rows(dtype: torch.dtype, rows: int, channels: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=gen) * 3
    x[:, 5] *= 40  # an outlier channel
    x[2] = 0.75  # a constant row: constant per-token groups
    x[3, :8] = torch.finfo(dtype).smallest_normal * 0.5  # subnormals
    x[9, :32] = torch.finfo(dtype).smallest_normal * 0.25  # whole groups of subnormals
    x[4, ::3] = torch.finfo(dtype).max * 0.9  # extreme magnitudes
    x[4, 1::3] = -torch.finfo(dtype).max * 0.9
    return x.to(dtype)


@pytest.mark.parametrize(("dtype", "kind", "config"), CASES)
def test_kernels_match_reference_bit_for_bit(dtype, kind, config) -> None:
    channels, n = 96, 21  # 12 words per token (padded tiles), a partial key block
    pool = _rows(dtype, 40, channels, seed=7)
    slots = torch.tensor([3, 17, 4, 9, 2, *range(20, 36)], dtype=torch.int64)
    layout = part_layout(n, channels, kind, config, dtype)

    ref_anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
    ref_residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
    encode_part(pool[slots], kind, config, ref_anchor, ref_residual)

    dev_pool, dev_slots = pool.to(DEVICE), slots.to(DEVICE)
    anchor = torch.full_like(ref_anchor, 0x5A, device=DEVICE)
    residual = torch.full_like(ref_residual, 0x5A, device=DEVICE)
    triton_kernels.encode_rows(dev_pool, dev_slots, kind, config, layout, anchor, residual)
    assert torch.equal(anchor.cpu(), ref_anchor)
    lossless = config.residual_is_variable  # coded by lossless_cuda.py: the kernel writes none of it
    assert torch.equal(residual.cpu(), torch.zeros_like(ref_residual) if lossless else ref_residual)

    for with_residual in (False, True) if not lossless else (False,):
        expect = torch.empty((n, channels), dtype=dtype)
        decode_part(ref_anchor, ref_residual if with_residual else None, kind, config, expect)
        out_pool = torch.zeros_like(dev_pool)
        triton_kernels.decode_rows(
            anchor, residual if with_residual else None, out_pool, dev_slots, kind, config, layout
        )
        out_pool = out_pool.cpu()
        assert torch.equal(out_pool[slots].view(torch.uint8), expect.view(torch.uint8))
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[slots] = False
        assert not out_pool[untouched].any()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_kernel_marks_non_finite_groups() -> None:
    config = CodecConfig()
    pool = _rows(torch.bfloat16, 20, 64, seed=1)
    pool[6, 9] = float("nan")
    pool[11, 40] = float("-inf")
    slots = torch.arange(20)
    for kind in ("key", "value"):
        layout = part_layout(20, 64, kind, config, torch.bfloat16)
        anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8, device=DEVICE)
        residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8, device=DEVICE)
        triton_kernels.encode_rows(pool.to(DEVICE), slots.to(DEVICE), kind, config, layout, anchor, residual)
        mins = anchor[: layout.param_nbytes].view(torch.bfloat16).cpu()
        assert int((~torch.isfinite(mins)).sum()) == 2
    with pytest.raises(ValueError, match="token 6"):
        raise_non_finite(pool, "in layer 0 keys", slots, 64)


def test_an_anchor_enqueued_on_the_device_is_encode_pages_anchor_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``enqueue_anchor_pages`` (the sender's layer-by-layer Anchors on a GPU) writes the
    Anchor ``encode_pages`` writes; it reads nothing back, so a NaN raises there and not
    here; a CPU pool is refused."""
    from lynx.codec import CodecInputError, KVLayout, encode_pages, enqueue_anchor_pages, segment_nbytes

    layout = KVLayout(2, 2, 64, torch.bfloat16)
    pool = [_rows(torch.bfloat16, 40, 128, seed).view(40, 2, 64).to(DEVICE) for seed in range(4)]
    k, v = pool[:2], pool[2:]
    slots = torch.tensor([3, 17, 5, 30, 8, 22, 11, 39, 0], device=DEVICE)
    config = CodecConfig(residual="exact")
    anchor_nbytes, residual_nbytes = segment_nbytes(layout, slots.numel(), config)
    expected = torch.empty(anchor_nbytes, dtype=torch.uint8, device=DEVICE)
    got = torch.empty_like(expected)
    with monkeypatch.context() as patch:
        if DEVICE == "cpu":
            patch.setattr(backend, "_use_triton", lambda t: True)
        residual = torch.empty(residual_nbytes, dtype=torch.uint8, device=DEVICE)
        encode_pages(k, v, slots, config, expected, residual)
        enqueue_anchor_pages(k, v, slots, config, got)
        assert torch.equal(got, expected)
        v[1][slots[4], 1, 7] = float("nan")
        enqueue_anchor_pages(k, v, slots, config, got)
        with pytest.raises(CodecInputError, match="nan in layer 1 values at token 4"):
            encode_pages(k, v, slots, config, expected, residual)
    if DEVICE == "cpu":
        with pytest.raises(CodecInputError, match="CUDA pool"):
            enqueue_anchor_pages(k, v, slots, config, got)
