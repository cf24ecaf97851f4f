"""The C++ CPU codec writes the same bytes and pool rows as the torch reference, bit for bit,
and refuses non-finite input with the reference's message. It is compiled when the package
is installed (setup.py), never when it is used; where it does not load, the reference serves
and one warning says why."""

import os
import platform
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx.codec import (
    CodecConfig,
    CodecInputError,
    KVLayout,
    backend,
    cpp_backend,
    cpp_build,
    decode_pages,
    encode_pages,
    reference,
    segment_nbytes,
)
from lynx.codec.cpp_backend import PartIO
from lynx.codec.format import part_layout
from lynx.codec.reference import decode_part, encode_part

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PATTERNS = ("normal", "random_bits", "constant", "signed_zero", "tiny", "huge", "outliers")


def _finite_bits(dtype: torch.dtype, count: int, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns, non-finite ones replaced by their sign's zero: every
    exponent, subnormals and both zeros included."""
    if dtype == torch.float32:
        words = torch.randint(-(2**31), 2**31, (count,), generator=gen, dtype=torch.int64).to(torch.int32)
    else:
        words = torch.randint(-(2**15), 2**15, (count,), generator=gen, dtype=torch.int32).to(torch.int16)
    x = words.view(dtype)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x).copysign(x))


def _pool(pattern: str, rows: int, channels: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, channels, generator=gen)
    big = torch.finfo(dtype).max
    if pattern == "random_bits":
        return _finite_bits(dtype, rows * channels, gen).view(rows, channels)
    if pattern == "constant":
        x = torch.full_like(x, 1.7)
    elif pattern == "signed_zero":
        x = torch.where(x > 0, 0.0, -0.0)
        x[::3] = torch.randn(x[::3].shape, generator=gen)
    elif pattern == "tiny":
        x = x * torch.finfo(dtype).smallest_normal * 0.25
    elif pattern == "huge":
        x = torch.where(x > 0, big, -big) * torch.rand(x.shape, generator=gen).clamp_min(0.5)
    elif pattern == "outliers":
        x = x + 40.0
        x[:, ::7] *= 100
    return x.to(dtype)


@st.composite
def parts(draw: st.DrawFn):
    head_dim = draw(st.sampled_from([8, 16, 64]))
    channels = head_dim * draw(st.integers(1, 3))
    config = CodecConfig(
        anchor_bits=draw(st.sampled_from([2, 3, 4])),
        group_size=draw(st.sampled_from([g for g in (8, 16, 32, 64) if g <= head_dim])),
        residual=draw(st.sampled_from(["int8", "exact"])),
        key_layout=draw(st.sampled_from(["per_channel", "per_token"])),
        key_block=draw(st.sampled_from([2, 4, 16, 32])),
    )
    n = draw(st.integers(0, 41))
    rows = n + draw(st.integers(0, 9))
    dtype = draw(st.sampled_from(DTYPES))
    pool = _pool(draw(st.sampled_from(PATTERNS)), rows, channels, dtype, draw(st.integers(0, 2**31)))
    order = draw(st.permutations(range(rows)))
    slots = torch.tensor(order[:n], dtype=torch.int64)
    return pool, slots, draw(st.sampled_from(["key", "value"])), config


@settings(max_examples=300, deadline=None)
@given(parts())
def test_cpp_matches_reference_bit_for_bit(case) -> None:
    pool, slots, kind, config = case
    n, channels = slots.numel(), pool.shape[1]
    layout = part_layout(n, channels, kind, config, pool.dtype)
    expect_anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
    expect_residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
    used = encode_part(pool[slots], kind, config, expect_anchor, expect_residual)

    anchor = torch.full_like(expect_anchor, 0x5A)
    residual = torch.full_like(expect_residual, 0x5A)
    assert cpp_backend.encode_parts([PartIO(pool, kind, anchor, residual)], slots, config) == [used]
    assert torch.equal(anchor, expect_anchor)
    assert torch.equal(residual, expect_residual)

    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    body = residual[:used]
    for with_residual in (False, True):
        expect = torch.empty((n, channels), dtype=pool.dtype)
        decode_part(expect_anchor, body if with_residual else None, kind, config, expect)
        out = torch.full_like(pool, 7.0)
        faults = cpp_backend.decode_parts(
            [PartIO(out, kind, anchor, body if with_residual else None)], slots, config
        )
        assert faults == [0]
        assert torch.equal(out[slots].view(torch.uint8), expect.view(torch.uint8))
        assert bool((out[untouched] == 7.0).all())
        if with_residual and config.residual == "exact":  # lossless: the pool's own words
            assert torch.equal(out[slots].view(torch.uint8), pool[slots].view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_the_reference_message(dtype, bad, monkeypatch) -> None:
    config = CodecConfig()
    pool = _pool("normal", 30, 64, dtype, seed=3)
    pool[17, 41] = bad
    slots = torch.tensor([4, 17, 9, 1, 0], dtype=torch.int64)
    layout = part_layout(5, 64, "key", config, dtype)
    anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
    residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
    assert cpp_backend.encode_parts([PartIO(pool, "key", anchor, residual)], slots, config) == [-1]

    messages = []
    for choice in ("reference", "cpp"):
        monkeypatch.setenv(backend.BACKEND_ENV, choice)
        with pytest.raises(CodecInputError) as err:
            backend.encode_rows(
                pool, slots, "key", config, anchor, residual, where="in layer 2 keys", head_dim=32
            )
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "slot 17" in messages[1] and "head 1, dim 9" in messages[1]


def test_backend_env_selects_the_path(monkeypatch) -> None:
    config = CodecConfig()
    pool = _pool("normal", 8, 64, torch.bfloat16, seed=5)
    layout = part_layout(8, 64, "value", config, torch.bfloat16)
    outputs = []
    for choice in ("reference", "cpp", ""):
        monkeypatch.setenv(backend.BACKEND_ENV, choice)
        anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
        residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
        backend.encode_rows(pool, None, "value", config, anchor, residual)
        outputs.append(torch.cat([anchor, residual]))
    assert all(torch.equal(outputs[0], out) for out in outputs[1:])
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    with pytest.raises(CodecInputError, match="LYNX_CODEC_BACKEND must be"):
        backend.encode_rows(pool, None, "value", config, anchor, residual)


def test_the_cpp_codec_takes_cpu_tensors_only(monkeypatch) -> None:
    # A CUDA server with the C++ codec built sent its pool's parts to it (found on a GPU).
    monkeypatch.setenv(backend.BACKEND_ENV, "cpp")
    assert backend._use_cpp(torch.empty(4, 64))
    assert not backend._use_cpp(torch.empty(4, 64, device="meta"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("array", "value"),
    [("mins", float("nan")), ("scales", float("inf")), ("scales", -0.5), ("scales", -0.0), ("mins", -3.0)],
)
def test_anchor_faults_match_the_reference(dtype, array, value) -> None:
    config = CodecConfig()
    layout = part_layout(21, 64, "key", config, dtype)
    anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
    residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
    part = PartIO(_pool("normal", 21, 64, dtype, 2), "key", anchor, residual)
    assert cpp_backend.encode_parts([part], None, config)[0] > 0
    assert cpp_backend.anchor_params_fault(anchor, layout, dtype) == 0
    sound = anchor.clone()
    offset = layout.mins_offset if array == "mins" else layout.scales_offset
    anchor[offset : offset + layout.param_nbytes].view(dtype)[layout.num_groups - 1] = value
    faults = reference.anchor_params_faults([sound, anchor, sound], [layout] * 3, dtype)
    fault = faults[1]
    assert faults == [0, fault, 0]
    assert fault == (2 if value == -0.5 else 1 if value != value or abs(value) == float("inf") else 0)
    assert cpp_backend.anchor_params_fault(anchor, layout, dtype) == fault


@pytest.mark.parametrize("significant_bits", [8, 11])
def test_reciprocal_division_is_exact_for_16_bit_scales(significant_bits) -> None:
    """The encoder divides bf16 (8 significant bits) and fp16 (11) scales by a reciprocal and
    one correction step; exhaustively over every pair of significands it equals the division."""
    assert cpp_backend.module().reciprocal_division_mismatches(significant_bits) == 0


def test_segment_in_one_region_matches_reference_and_locates_non_finite(monkeypatch) -> None:
    """encode_pages/decode_pages hand all parts to the C++ codec at once: same bytes and rows,
    and a NaN in a later layer raises the reference's message."""
    config = CodecConfig(anchor_bits=3, key_block=4)
    layout = KVLayout(3, 2, 32, torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    pools = [(torch.randn(50, 2, 32, generator=gen) * 5).to(torch.bfloat16) for _ in range(6)]
    slots = torch.tensor([7, 3, 40, 41, 8, 19, 22, 5, 30, 1, 2], dtype=torch.int64)
    sizes = segment_nbytes(layout, slots.numel(), config)
    outputs = {}
    for choice in ("reference", "cpp"):
        monkeypatch.setenv(backend.BACKEND_ENV, choice)
        k, v = [p.clone() for p in pools[::2]], [p.clone() for p in pools[1::2]]
        anchor = torch.full((sizes[0],), 0x5A, dtype=torch.uint8)
        residual = torch.full((sizes[1],), 0x5A, dtype=torch.uint8)
        encode_pages(k, v, slots, config, anchor, residual)
        decode_pages(anchor, residual, k, v, slots, config)
        full = torch.cat([b.view(torch.uint8).reshape(-1) for b in k + v])
        decode_pages(anchor, None, k, v, slots, config)
        anchor_only = torch.cat([b.view(torch.uint8).reshape(-1) for b in k + v])
        outputs[choice] = (anchor, residual, full, anchor_only)
    assert all(torch.equal(a, b) for a, b in zip(outputs["reference"], outputs["cpp"], strict=True))

    pools[3][30, 1, 5] = float("nan")  # layer 1 values, slot 30
    messages = []
    for choice in ("reference", "cpp"):
        monkeypatch.setenv(backend.BACKEND_ENV, choice)
        with pytest.raises(CodecInputError) as err:
            encode_pages(pools[::2], pools[1::2], slots, config, anchor, residual)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    assert "layer 1 values" in messages[1] and "slot 30" in messages[1]


def test_other_threads_run_while_the_cpp_codec_codes(monkeypatch) -> None:
    """encode_rows and decode_rows release the GIL: while prefill encodes a request's
    Residuals, its lanes' driver and upstream's workers (Python threads) send the Anchor's
    end and the first token. A thread that only notes the time every millisecond gets
    turns inside each long call (none if the call held the GIL)."""
    monkeypatch.setenv(backend.BACKEND_ENV, "cpp")
    real = cpp_backend.module()
    calls: dict[str, tuple[float, float]] = {}

    def timed(name: str):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return getattr(real, name)(*args, **kwargs)
            finally:
                calls[name] = (start, time.perf_counter())

        return call

    names = ("encode_rows", "decode_rows")
    proxy = SimpleNamespace(**{n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    for name in names:
        setattr(proxy, name, timed(name))
    monkeypatch.setattr(cpp_backend, "module", lambda: proxy)

    config = CodecConfig()
    layout = KVLayout(8, 4, 128, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    k = [torch.randn(4096, 4, 128, generator=gen).to(torch.bfloat16) for _ in range(8)]
    v = [torch.randn(4096, 4, 128, generator=gen).to(torch.bfloat16) for _ in range(8)]
    slots = torch.arange(4096)
    sizes = segment_nbytes(layout, slots.numel(), config)
    anchor = torch.empty(sizes[0], dtype=torch.uint8)
    residual = torch.empty(sizes[1], dtype=torch.uint8)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        encode_pages(k, v, slots, config, anchor, residual)
        decode_pages(anchor, residual, k, v, slots, config)
    finally:
        stop.set()
        ticker.join()
    margin = 0.005  # a turn the switch interval gave the ticker at a call's edge is no proof
    for name in names:
        start, end = calls[name]
        assert end - start > 4 * margin, f"{name} was too short to tell"
        assert any(start + margin < t < end - margin for t in ticks), f"{name} held the GIL"


def test_the_installed_module_loads_without_a_compiler(tmp_path) -> None:
    # A fresh interpreter (nothing loaded yet) where compiling is impossible: no compiler on
    # PATH, an empty extension cache, and torch's JIT entry points refuse.
    script = textwrap.dedent(
        """
        from torch.utils import cpp_extension

        def refuse(*_args, **_kwargs):
            raise AssertionError("a compiler was invoked")

        cpp_extension.load = cpp_extension.load_inline = cpp_extension._jit_compile = refuse
        from lynx.codec import backend, cpp_backend

        assert cpp_backend.available()
        print(backend.warm_up("cpu"))
        """
    )
    env = {
        **os.environ,
        "PATH": str(tmp_path),
        "CXX": str(tmp_path / "c++"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path),
    }
    env.pop(backend.BACKEND_ENV, None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["cpp"]
    assert "reference" not in out.stderr


@pytest.fixture
def unloaded(monkeypatch):
    """cpp_backend as before its first load, whatever an earlier test loaded; restored after."""
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    cpp_backend._load.cache_clear()
    yield
    cpp_backend._load.cache_clear()


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == cpp_backend.__name__ and r.levelname == "WARNING"
    ]


@pytest.mark.usefixtures("unloaded")
def test_warm_up_names_the_codec_that_runs(monkeypatch, caplog) -> None:
    assert backend.warm_up("cpu") == "cpp"
    assert backend.warm_up(torch.device("cuda")) == "triton"  # no CUDA needed to name it
    monkeypatch.setenv(backend.BACKEND_ENV, "reference")
    assert backend.warm_up("cpu") == "reference"
    assert not _warnings(caplog)


@pytest.mark.usefixtures("unloaded")
def test_a_missing_build_warns_once_at_warm_up_and_the_reference_serves(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpp_build, "MODULE", "lynx.codec._cpu_codec_never_built")
    config = CodecConfig()
    pool = _pool("normal", 8, 64, torch.bfloat16, seed=9)
    layout = part_layout(8, 64, "value", config, torch.bfloat16)
    expect_anchor = torch.empty(layout.anchor_nbytes, dtype=torch.uint8)
    expect_residual = torch.empty(layout.residual_nbytes, dtype=torch.uint8)
    encode_part(pool, "value", config, expect_anchor, expect_residual)

    assert backend.warm_up("cpu") == "reference"
    (warning,) = _warnings(caplog)  # at start-up, before any request
    assert "not built" in warning and cpp_backend.HOW_TO_BUILD in warning and cpp_backend.COST in warning
    for _ in range(2):
        anchor = torch.empty_like(expect_anchor)
        residual = torch.empty_like(expect_residual)
        backend.encode_rows(pool, None, "value", config, anchor, residual)
        assert torch.equal(anchor, expect_anchor) and torch.equal(residual, expect_residual)
    assert len(_warnings(caplog)) == 1
    monkeypatch.setenv(backend.BACKEND_ENV, "cpp")
    with pytest.raises(cpp_backend.NativeBuildError, match="not built"):
        backend.encode_rows(pool, None, "value", config, anchor, residual)
    with pytest.raises(cpp_backend.NativeBuildError, match="not built"):
        backend.warm_up("cpu")


@pytest.mark.usefixtures("unloaded")
def test_a_stale_build_is_refused(monkeypatch, caplog) -> None:
    # What an editable install's in-place build is after its sources or flags change.
    monkeypatch.setattr(cpp_build, "source_digest", lambda: "0" * 16)
    assert backend.warm_up("cpu") == "reference"
    (warning,) = _warnings(caplog)
    assert "stale build" in warning and cpp_backend.HOW_TO_BUILD in warning


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the CPU check reads x86 flags")
@pytest.mark.usefixtures("unloaded")
def test_a_cpu_without_what_it_was_compiled_for_is_refused(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpp_build, "CPU_FLAGS", (*cpp_build.CPU_FLAGS, "avx10_9"))
    assert not cpp_backend.available()
    (warning,) = _warnings(caplog)
    assert "needs avx10_9, which this CPU lacks" in warning


def test_the_cpp_bindings_check_every_length_and_slot_they_are_given() -> None:
    """Old: ``decode_rows`` checked neither the Anchor's size against the part's geometry nor
    the slots against the rows, and neither binding the slots (callers guarded both): a
    short buffer or a stray slot read or wrote out of bounds. Each now raises, naming it."""
    config = CodecConfig(residual="int8")  # a fixed-width Residual: its length is checked too
    rows = torch.randn(8, 64).to(torch.bfloat16)
    kind = "value"
    layout = part_layout(8, 64, kind, config, torch.bfloat16)
    anchor = torch.zeros(layout.anchor_nbytes, dtype=torch.uint8)
    residual = torch.zeros(layout.residual_nbytes, dtype=torch.uint8)
    cpp_backend.encode_parts([PartIO(rows, kind, anchor, residual)], None, config)
    out = torch.zeros(16, 64, dtype=torch.bfloat16)
    slots = torch.arange(8, dtype=torch.int64)
    cpp_backend.decode_parts([PartIO(out, kind, anchor, residual)], slots, config)
    want = torch.zeros(8, 64, dtype=torch.bfloat16)
    reference.decode_part(anchor, residual, kind, config, want)
    assert torch.equal(out[:8], want)

    cases = {
        "anchor buffer of": PartIO(out, kind, anchor[: -1 - layout.anchor_nbytes // 2], residual),
        "residual buffer of": PartIO(out, kind, anchor, residual[: layout.residual_nbytes // 2]),
    }
    for message, part in cases.items():
        with pytest.raises(RuntimeError, match=message):
            cpp_backend.decode_parts([part], slots, config)
    for bad in (torch.tensor([0, 16]), torch.tensor([-1, 3]), torch.tensor([1 << 40])):
        with pytest.raises(RuntimeError, match="is outside the 16 rows"):
            cpp_backend.decode_parts([PartIO(out, kind, anchor, residual)], bad, config)
        with pytest.raises(RuntimeError, match="is outside the 16 rows"):
            cpp_backend.encode_parts([PartIO(out, kind, anchor.clone(), residual.clone())], bad, config)
    module = cpp_backend.module()
    geometry = ([False], config.group_size, config.key_block)
    with pytest.raises(RuntimeError, match="anchor offsets out of order"):  # scales over the minimums
        module.decode_rows(
            [anchor], [residual], [out], slots, *geometry, 4, False, [0], [layout.codes_offset], 1
        )
    with pytest.raises(RuntimeError, match=r"anchor bits must be 2\.\.4"):
        module.decode_rows(
            [anchor],
            [residual],
            [out],
            slots,
            *geometry,
            9,
            False,
            [layout.scales_offset],
            [layout.codes_offset],
            1,
        )
