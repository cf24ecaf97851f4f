"""The lossless Residual (``lynx.codec.lossless``): its Huffman codes, bit-exact round trips
on hostile data, the raw fallback, and corrupt bodies refused alike by the reference and
the C++ codec."""

import numpy as np
import pytest
import torch

from lynx.codec import CodecConfig, CodecInputError, backend, cpp_backend, decode, encode, lossless

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BACKENDS = ["reference", "cpp"] if cpp_backend.available() else ["reference"]


def test_code_lengths_are_complete_limited_and_pinned() -> None:
    assert lossless.code_lengths([0, 5, 0]) == [0, 1, 0]  # one symbol: coded in zero bits
    assert lossless.code_lengths([0, 0]) == [0, 0]
    assert lossless.code_lengths([10, 10, 20, 40]) == [3, 3, 2, 1]
    assert lossless.canonical_codes([3, 3, 2, 1]) == [0b011, 0b111, 0b01, 0b0]  # bit-reversed
    fibonacci = [1, 1]
    while len(fibonacci) < 18:
        fibonacci.append(fibonacci[-1] + fibonacci[-2])
    assert max(lossless._huffman_depths(fibonacci, list(range(18))).values()) == 17  # unlimited
    lengths = lossless.code_lengths(fibonacci)
    assert max(lengths) <= lossless.MAX_CODE_BITS
    assert sum(2.0**-n for n in lengths) == 1.0


@pytest.mark.parametrize("compiled", [True, False] if cpp_backend.available() else [False])
def test_huffman_codes_of_many_tables_are_the_specifications(compiled: bool, monkeypatch) -> None:
    gen = np.random.default_rng(0)
    fibonacci = [1, 1]
    while len(fibonacci) < 18:
        fibonacci.append(fibonacci[-1] + fibonacci[-2])
    counts = [
        [0] * 18,
        [0, 7] + [0] * 16,
        fibonacci,  # limited to MAX_CODE_BITS
        *(gen.integers(0, 1000, 18) * (gen.random(18) < 0.6) for _ in range(40)),
        *(gen.integers(0, 1 << 40, 34) for _ in range(3)),
    ]
    if not compiled:
        monkeypatch.setattr(cpp_backend, "available", lambda: False)
    for rows in (np.array(counts[:-3], dtype=np.int64), np.array(counts[-3:], dtype=np.int64)):
        lengths, codes = cpp_backend.huffman_codes(rows)
        for row, found, code in zip(rows, lengths, codes, strict=True):
            assert found.tolist() == lossless.code_lengths(row.tolist())
            assert code.tolist() == lossless.canonical_codes(found.tolist())


def _hostile(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    special = [
        0.0,
        -0.0,
        info.tiny,
        -info.tiny,
        info.tiny / 4,
        -info.tiny / 8,
        info.max,
        -info.max,
        1.0,
        -1.0,
    ]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 2, 32, generator=gen).to(dtype)
    x.view(-1)[: len(special) * 4] = torch.tensor(special * 4, dtype=torch.float64).to(dtype)
    x[5] = 0.75  # all-equal groups
    x[6] = -0.0
    x[7, 0] = info.tiny / 2  # subnormals throughout a row
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["key", "value"])
def test_hostile_data_round_trips_bit_for_bit_with_the_same_bytes_on_every_path(
    dtype: torch.dtype, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _hostile(dtype)
    config = CodecConfig(group_size=16)
    encoded = {}
    for name in BACKENDS:
        monkeypatch.setenv(backend.BACKEND_ENV, name)
        enc = encode(x, config, kind=kind)  # type: ignore[arg-type]
        y = decode(enc.anchor, enc.residual, config=config, shape=x.shape, dtype=dtype, kind=kind)  # type: ignore[arg-type]
        assert torch.equal(y.view(torch.uint8), x.view(torch.uint8)), name
        encoded[name] = enc
    assert all(torch.equal(e.residual, encoded["reference"].residual) for e in encoded.values())


def test_incompressible_words_are_stored_raw() -> None:
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**15), 2**15, (16, 64), generator=gen, dtype=torch.int16)
    x = words.view(torch.bfloat16)
    x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))
    enc = encode(x, CodecConfig(), kind="value")
    assert enc.residual[0] == lossless.RAW and enc.residual.numel() == 1 + x.numel() * 2
    back = decode(enc.anchor, enc.residual, config=CodecConfig(), shape=x.shape, dtype=x.dtype)
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


def _coded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = (torch.linspace(-3, 3, 1024) ** 3).view(16, 64).to(torch.bfloat16)  # two blocks
    enc = encode(x, CodecConfig(), kind="value")
    assert enc.residual[0] == lossless.CODED
    return x, enc.anchor, enc.residual


def _corruptions(residual: torch.Tensor) -> dict[str, tuple[torch.Tensor, str]]:
    table = lossless.word_format(torch.bfloat16).table_nbytes
    count = int(residual[1])
    out = {}
    out["truncated"] = (residual[:-1].clone(), "")
    out["longer"] = (torch.cat([residual, torch.zeros(1, dtype=torch.uint8)]), "")
    bad_format = residual.clone()
    bad_format[0] = 9
    out["format"] = (bad_format, "format")
    unordered = residual.clone()
    unordered[2 + table] = unordered[2]  # the second table's context equals the first's
    out["order"] = (unordered, "order|range|table")
    incomplete = residual.clone()
    incomplete[3] = 0  # drop the lengths of symbols 0 and 1 of the first table
    out["incomplete"] = (incomplete, "complete|table|context")
    too_few = residual.clone()
    too_few[1] = count - 1  # a context of some value loses its table
    out["no table"] = (too_few, "")
    moved = residual.clone()  # a bit moved from block 0's count to block 1's: the sum holds
    counts = moved[2 + count * table : 2 + count * table + 4].view(torch.int16)
    counts[0] -= 1
    counts[1] += 1
    out["blocks"] = (moved, "block")
    return out


@pytest.mark.parametrize("name", BACKENDS)
def test_corrupt_bodies_are_refused_on_every_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend.BACKEND_ENV, name)
    x, anchor, residual = _coded()
    for what, (body, match) in _corruptions(residual).items():
        with pytest.raises(CodecInputError, match=match or "corrupt lossless residual") as err:
            decode(anchor, body, config=CodecConfig(), shape=x.shape, dtype=x.dtype)
        assert "corrupt lossless residual" in str(err.value), what
    padded = residual.clone()
    padded[-1] |= 0x80  # a bit past the last value (the stream ends mid-byte here)
    out = None
    try:
        out = decode(anchor, padded, config=CodecConfig(), shape=x.shape, dtype=x.dtype)
    except CodecInputError as exc:
        assert "corrupt lossless residual" in str(exc)
    if out is not None:  # the last byte was full: the flipped bit changed a value's raw bits
        assert not torch.equal(out.view(torch.int16), x.view(torch.int16))


def test_a_header_with_no_whole_table_or_short_data_is_the_codecs_error() -> None:
    """``read_header`` (the reference decoder's and the GPU path's host-side check) raised
    numpy's bare ValueError for a body that holds no whole code table."""
    fmt = lossless.word_format(torch.bfloat16)
    _, _, residual = _coded()
    body = bytes(residual.tolist())
    for cut in (2, 3, 2 + fmt.table_nbytes - 1):  # a table count, then less than one table
        with pytest.raises(CodecInputError, match="corrupt lossless residual"):
            lossless.read_header(body[:cut], cut, 1024, fmt)
    for given in (0, 1, 10):  # fewer bytes than the length claimed and the header needs
        with pytest.raises(CodecInputError, match=f"{given} given"):
            lossless.read_header(body[:given], len(body), 1024, fmt)


def test_a_nan_word_in_a_raw_body_is_refused() -> None:
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    enc = encode(x, CodecConfig(), kind="value")
    body = torch.cat([torch.zeros(1, dtype=torch.uint8), x.clone().view(-1).view(torch.uint8)])
    body[1:3] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
    for name in BACKENDS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(backend.BACKEND_ENV, name)
            with pytest.raises(CodecInputError, match="NaN or infinite"):
                decode(enc.anchor, body, config=CodecConfig(), shape=x.shape, dtype=x.dtype)
