"""benchmark/revisions.py's own logic, without servers: its command line, the order the
revisions run in and how their requests become the side-by-side rows."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))


@pytest.fixture(scope="module")
def revisions() -> ModuleType:
    # Imported when the tests run, not at collection (transformers, as in test_benchmark_suite).
    import revisions as module

    return module


def checkout(root: Path, codec: bool = True) -> Path:
    for package in ("lynx", "lynx_patches"):
        (root / "python" / package).mkdir(parents=True)
        (root / "python" / package / "__init__.py").write_text("")
    (root / "python/lynx/codec").mkdir()
    if codec:
        (root / "python/lynx/codec/_cpu_codec.cpython-311-x86_64-linux-gnu.so").write_text("")
    return root


def test_revisions_parse_as_name_equals_checkout(revisions: ModuleType, tmp_path: Path) -> None:
    a, b = checkout(tmp_path / "a"), checkout(tmp_path / "b")
    args = revisions.parse_args(["--revision", f"old={a}", "--revision", f"new={b}"])
    assert [(r.name, r.path) for r in args.revisions] == [("old", a), ("new", b)]
    assert args.configs == ["lynx-full", "lynx-speculative"] and args.rounds == 2
    assert args.revisions[0].env()["PYTHONPATH"].split(":")[0] == str(a / "python")
    assert revisions.parse_revision("x=rel").path == Path("rel").resolve()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--revision", "a"], "expected NAME=PATH"),
        (["--revision", "=/x"], "expected NAME=PATH"),
        (["--revision", "A"], "at least two"),
        (["--revision", "A", "--revision", "A"], "must differ"),
        (["--revision", "A", "--revision", "B=/nonexistent"], "not a checkout"),
        (
            ["--revision", "A", "--revision", "bare"],
            "lacks the compiled C++ codec python/lynx/codec/_cpu_codec",
        ),
    ],
)
def test_bad_revisions_exit_2(
    revisions: ModuleType, tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {"A": f"A={checkout(tmp_path / 'a')}", "bare": f"bare={checkout(tmp_path / 'bare', codec=False)}"}
    with pytest.raises(SystemExit) as exit_info:
        revisions.parse_args([names.get(arg, arg) for arg in argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_turns_alternate_the_order(revisions: ModuleType) -> None:
    a, b = revisions.Revision("a", Path("/a")), revisions.Revision("b", Path("/b"))
    turns = revisions.schedule([a, b], 2)
    assert [(r, rev.name) for r, rev in turns] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]


def _run(round_: int, prompt: int, ttft: float, kv_bytes: int, output: list[int]) -> dict:
    times = {1: ttft, 8: ttft + 1.0}
    return {
        "round": round_,
        "context": 256,
        "prompt": prompt,
        "times": times,
        "kv_bytes": kv_bytes,
        "output_ids": output,
    }


def test_rows_compare_each_request_with_the_baselines_first(revisions: ModuleType) -> None:
    base = [_run(0, 0, 1.0, 100, [1, 2]), _run(0, 1, 3.0, 200, [3, 4]), _run(1, 0, 2.0, 100, [1, 2])]
    same = [_run(0, 0, 2.0, 100, [1, 2]), _run(0, 1, 4.0, 200, [3, 4])]
    other = [_run(0, 0, 2.0, 100, [1, 2]), _run(0, 1, 4.0, 300, [3, 5])]
    rows = revisions.compare({"before": base, "after": same, "other": other}, [256], [8])
    first, after, changed = rows
    assert first["revision"] == "before" and first["identical_outputs"] == 3 and first["bytes_same"]
    assert first["ttft_256"] == 2.0 and first["ttft_256_rounds"] == [2.0, 2.0]
    assert after["bytes_same"] and after["bytes_ratio"] == 1.0 and after["identical_outputs"] == 2
    assert after["ttft_256"] == 3.0 and after["ttft_256_ratio"] == 1.5 and after["t8_256_ratio"] == 4.0 / 3.0
    assert not changed["bytes_same"] and changed["bytes_ratio"] == 400 / 300
    assert changed["identical_outputs"] == 1
    table = revisions.table({"lynx-full": rows}, [256], [8])
    assert (
        "| lynx-full | after | 150 | same (1.0000) | 2/2 identical | 3.00 s (1.50) | 4.00 s (1.33) |" in table
    )
    assert "| differs (1.3333) | 1/2 identical |" in table
