"""benchmark/chunk_sweep.py's own logic, without servers: its command line and how the
requests of each (configuration, chunk size) become rows with ratios to plain PD at the
default and at its best chunk size."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    # Imported when the tests run, not at collection (transformers, as in test_benchmark_suite).
    import chunk_sweep as module

    return module


def requests(ttft: float, token32: float, kv_bytes: int | None = None) -> list[dict[str, Any]]:
    """Three requests of a 2048-token prompt, their median at the given times."""
    return [
        {"context": 2048, "times": {1: ttft * f, 32: token32 * f}, "kv_bytes": kv_bytes}
        for f in (0.9, 1.0, 1.2)
    ]


def test_ratios_are_to_plain_pd_at_the_default_and_at_its_best_chunk(sweep: ModuleType) -> None:
    runs = {
        "bf16": {512: requests(20.0, 22.0), 2048: requests(32.0, 34.0)},
        "lynx-speculative": {512: requests(15.0, 30.0, 5000), 2048: requests(18.0, 33.0, 5000)},
    }
    rows = {(r["config"], r["chunk"]): r for r in sweep.summarize(runs, [2048], [32], default_chunk=2048)}
    plain_best = rows["bf16", 512]
    assert plain_best["best_bf16_chunk_2048"] == 512
    assert plain_best["ttft_2048_vs_default"] == pytest.approx(20 / 32)
    assert plain_best["ttft_2048_vs_best"] == pytest.approx(1.0)
    lynx = rows["lynx-speculative", 512]
    assert lynx["ttft_2048"] == pytest.approx(15.0) and lynx["kv_bytes_per_request"] == 5000
    assert lynx["ttft_2048_vs_default"] == pytest.approx(15 / 32)
    assert lynx["ttft_2048_vs_best"] == pytest.approx(15 / 20)
    assert lynx["t32_2048_vs_best"] == pytest.approx(30 / 22)
    assert rows["bf16", 2048]["kv_bytes_per_request"] is None  # plain PD sends no Lynx report
    table = sweep.table(list(rows.values()), [2048], [32], 2048)
    assert "| lynx-speculative | 512 | 5,000 | 15.0 s (0.47 / 0.75) |" in table
    assert "at its best chunk: 2048 tokens: 512" in table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--configs", "lynx-speculative"], "must include bf16"),
        (["--chunks", "512", "512"], "distinct positive"),
        (["--chunks", "512", "1024", "--default-chunk", "4096"], "not among --chunks"),
    ],
)
def test_bad_sweeps_exit_2(
    sweep: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        sweep.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_default_chunk_is_the_largest_swept(sweep: ModuleType) -> None:
    args = sweep.parse_args(["--chunks", "256", "1024", "512"])
    assert args.default_chunk == 1024 and args.configs == ["bf16", "lynx-speculative"]


def test_interleaved_configurations_take_turns_first(sweep: ModuleType) -> None:
    configs = ["bf16", "lynx-full-chunkwise", "lynx-speculative"]
    assert sweep.turn_order(configs, 0) == configs
    assert sweep.turn_order(configs, 1) == configs[::-1]
    assert sweep.turn_order(configs, 2) == configs
    assert sweep.parse_args(["--interleave"]).interleave


def test_interleaved_requests_alternate_between_the_pairs(
    sweep: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[tuple[str, int, int]] = []

    class Pair:
        def __init__(self, name: str) -> None:
            self.name = name

        def generate(self, prompt: str, max_new_tokens: int) -> None:
            served.append((self.name, -1, -1))

    def measure_one(
        pair: Any, context: int, index: int, text: str, marks: list[int], round_: int
    ) -> dict[str, Any]:
        served.append((pair.name, context, index))
        return {"context": context, "prompt": index}

    monkeypatch.setattr(sweep, "measure_one", measure_one)
    runs = sweep.interleaved({"a": Pair("a"), "b": Pair("b")}, {256: ["x", "y"], 2048: ["z"]}, [32])
    assert served == [
        ("a", -1, -1), ("b", -1, -1),  # warm-ups
        ("a", 256, 0), ("b", 256, 0), ("b", 256, 1), ("a", 256, 1), ("a", 2048, 0), ("b", 2048, 0),
    ]  # fmt: skip
    assert [r["prompt"] for r in runs["a"]] == [0, 1, 0] and len(runs["b"]) == 3
