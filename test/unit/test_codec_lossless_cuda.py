"""The device coder of the lossless Residual (``lossless_cuda``) writes the CPU codec's bytes
and decodes them bit for bit, and refuses what the CPU codec refuses, before it returns
anything.

Without a GPU its kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set here
before Triton is first imported) on CPU tensors; with one, on the GPU (the GPU check's
``codec`` step runs this file there). Shapes stay small: the interpreter runs every
program in Python.
"""

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

from lynx.codec import CodecConfig, CodecInputError, backend, lossless, lossless_cuda  # noqa: E402
from lynx.codec.format import part_layout  # noqa: E402
from lynx.codec.lossless_cuda import LosslessPart  # noqa: E402

TOKENS, CHANNELS = 24, 64  # 1,536 values a part: three blocks


def _hostile(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, CHANNELS, generator=gen) * 2
    x[:, 5] *= 60  # an outlier channel
    x[2] = 0.75  # all-equal groups
    x[3, :8] = torch.finfo(dtype).smallest_normal * 0.25  # subnormals
    x[4, ::3] = torch.finfo(dtype).max * 0.9  # extreme magnitudes
    x[4, 1::3] = -torch.finfo(dtype).max * 0.9
    x = x.to(dtype)
    x[5, :16] = -0.0
    return x


def _incompressible(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    words = torch.randint(-(2**15), 2**15, (TOKENS, CHANNELS), generator=gen, dtype=torch.int16)
    x = words.view(dtype)
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=dtype))


# (dtype, [(kind, values)], config): each case is one call with several parts
CASES = [
    (torch.bfloat16, CodecConfig()),
    (torch.float16, CodecConfig(anchor_bits=3, group_size=16, key_block=4)),
    (torch.bfloat16, CodecConfig(anchor_bits=2, key_layout="per_token", group_size=8)),
]


def _cpu_parts(dtype: torch.dtype, config: CodecConfig):
    """(kind, values, Anchor, body) of four parts, coded by the CPU codec."""
    parts = []
    for kind, x in (
        ("key", _hostile(dtype, 1)),
        ("value", _hostile(dtype, 2)),
        ("key", (torch.linspace(-3, 3, TOKENS * CHANNELS) ** 3).view(TOKENS, CHANNELS).to(dtype)),
        ("value", _incompressible(dtype)),  # last: a raw part's coded length may pass the end
    ):
        layout = part_layout(TOKENS, CHANNELS, kind, config, dtype)
        anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
        residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
        used = backend.encode_rows(x, None, kind, config, anchor, residual)
        parts.append((kind, x, anchor, residual[:used].clone()))
    return parts


def _device_parts(parts) -> list[LosslessPart]:
    return [LosslessPart(anchor.to(DEVICE), kind, (TOKENS, CHANNELS)) for kind, _, anchor, _ in parts]


@pytest.mark.parametrize(("dtype", "config"), CASES)
def test_the_device_coder_writes_the_cpu_codecs_bytes_and_decodes_them_bit_for_bit(dtype, config) -> None:
    parts = _cpu_parts(dtype, config)
    formats = [body[0].item() for *_, body in parts]
    assert formats.count(lossless.CODED) >= 3
    if config == CodecConfig():  # random bf16 words in wide groups code no smaller than they are
        assert formats[3] == lossless.RAW
    outs = [
        torch.full(
            (lossless.max_body_nbytes(TOKENS * CHANNELS, dtype),), 0x5A, dtype=torch.uint8, device=DEVICE
        )
    ]
    outs = [outs[0].clone() for _ in parts]
    used = lossless_cuda.encode_bodies(
        _device_parts(parts), [x.to(DEVICE) for _, x, _, _ in parts], config, outs
    )
    for (kind, _, _, body), out, length in zip(parts, outs, used, strict=True):
        assert length == body.numel(), kind
        assert torch.equal(out[:length].cpu(), body), kind
        assert not out[length:].any(), "the rest of the capacity is zeroed"
    decoded = lossless_cuda.decode_bodies(
        _device_parts(parts), [body.to(DEVICE) for *_, body in parts], dtype, config, ["a", "b", "c", "d"]
    )
    for (_, x, _, _), y in zip(parts, decoded, strict=True):
        assert y.shape == x.shape and y.dtype == dtype
        assert torch.equal(y.cpu().view(torch.int16), x.view(torch.int16))


def _corrupt(body: torch.Tensor) -> dict[str, tuple[torch.Tensor, str]]:
    """A coded body of three blocks made corrupt in each way a decoder must catch."""
    fmt = lossless.word_format(torch.bfloat16)
    blocks_at = 2 + int(body[1]) * fmt.table_nbytes
    out = {}
    out["truncated"] = (body[:-1].clone(), "bit stream of|block table")
    out["longer"] = (torch.cat([body, torch.zeros(1, dtype=torch.uint8)]), "bit stream of|block table")
    unknown = body.clone()
    unknown[0] = 7
    out["format"] = (unknown, "format")
    moved = body.clone()  # a bit moved from block 0's count to block 1's: the sum holds
    counts = moved[blocks_at : blocks_at + 4].view(torch.int16)
    counts[0] -= 1
    counts[1] += 1
    out["blocks"] = (moved, "block")
    too_few = body.clone()
    too_few[1] -= 1  # the last table read as the block table: some context has no table
    out["no table"] = (too_few, "")
    many = body.clone()
    many[1] = 200
    out["tables"] = (many, "code tables|context|table")
    return out


def test_corrupt_bodies_are_refused_and_nothing_is_returned() -> None:
    config = CodecConfig()
    parts = _cpu_parts(torch.bfloat16, config)
    (kind, x, anchor, body), good = parts[0], parts[1]
    for what, (bad, match) in _corrupt(body).items():
        with pytest.raises(CodecInputError, match="corrupt lossless residual") as err:
            lossless_cuda.decode_bodies(
                _device_parts([good, parts[0]]),
                [good[3].to(DEVICE), bad.to(DEVICE)],
                torch.bfloat16,
                config,
                ["layer 0 values", "layer 0 keys"],
            )
        assert "layer 0 keys" in str(err.value), what
        if match:
            assert any(word in str(err.value) for word in match.split("|")), (what, str(err.value))
        with pytest.raises(CodecInputError):  # the CPU codec refuses it too
            backend.decode_rows(anchor, bad, torch.empty_like(x), None, kind, config)


def test_padding_bits_and_non_finite_raw_words_are_refused() -> None:
    config = CodecConfig()
    parts = _cpu_parts(torch.bfloat16, config)
    _, x, _, body = parts[2]
    stream_end = lossless.read_header(
        body.numpy().tobytes(), body.numel(), x.numel(), lossless.word_format(x.dtype)
    )
    assert stream_end.block_starts[-1] % 8, "the stream ends mid-byte: there is padding to set"
    padded = body.clone()
    padded[-1] |= 0x80
    raw_body = parts[3][3]
    nan = raw_body.clone()
    nan[1:3] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
    for part, bad, match in ((parts[2], padded, "past the last value"), (parts[3], nan, "NaN or infinite")):
        with pytest.raises(CodecInputError, match=match):
            lossless_cuda.decode_bodies(
                _device_parts([part]), [bad.to(DEVICE)], torch.bfloat16, config, ["p"]
            )


def test_a_segment_through_the_device_path_has_the_cpu_codecs_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """encode_pages and decode_pages of a pool on the device (here, without a GPU, CPU
    tensors sent down the device path) digest as the C++ codec's, in every codec mode."""
    from lynx.codec import KVLayout
    from lynx.tools.codec_bench import MODES, cpu_backend, make_segment

    layout = KVLayout(2, 3, 64, torch.bfloat16)
    for name, config in MODES.items():
        with cpu_backend("cpp" if backend.cpp_backend.available() else "reference"):
            expected = make_segment(layout, 12, config, "cpu").digests()
        with monkeypatch.context() as patch:
            if DEVICE == "cpu":
                patch.setattr(backend, "_use_triton", lambda t: True)
            assert make_segment(layout, 12, config, DEVICE).digests() == expected, name
