"""benchmark/suite.py's own logic, without servers: the plan it runs, the statistics it
reports, the retrieval task it builds and how it turns raw runs into table rows."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))


@pytest.fixture(scope="module")
def suite() -> ModuleType:
    # Imported when the tests run, not at collection: it loads transformers and with it
    # Triton, before test_codec_triton.py turns the Triton interpreter on.
    import suite as module

    return module


def test_percentile_interpolates_between_ranks(suite: ModuleType) -> None:
    assert suite.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert suite.percentile([1.0, 2.0], 0.5) == 1.5
    assert suite.percentile([1.0, 2.0, 3.0, 4.0, 100.0], 0.99) == pytest.approx(96.16)
    assert suite.percentile([5.0], 0.99) == 5.0
    with pytest.raises(ValueError):
        suite.percentile([], 0.5)


def test_arrivals_start_at_zero_spread_within_the_window_and_repeat(suite: ModuleType) -> None:
    offsets = suite.arrivals(16, 5.0, seed=16)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(offsets) == 16
    assert all(0.0 <= t <= 5.0 for t in offsets) and offsets[-1] > 2.5
    assert suite.arrivals(16, 5.0, seed=16) == offsets
    assert suite.arrivals(1, 5.0, seed=1) == [0.0]


def test_quick_plan_and_explicit_choices(suite: ModuleType) -> None:
    quick = suite.parse_args(["--quick"])
    assert quick.models == ["smollm2"] and quick.links == ["20mbit"] and quick.loads == [1, 4]
    assert quick.configs[0] == "bf16" and "fp8" in quick.configs
    full = suite.parse_args([])
    assert set(full.configs) == set(suite.CONFIGS) and full.models == ["smollm2", "qwen2.5-coder-0.5b"]
    assert full.contexts == [2048, 4096, 8192] and full.links == ["20mbit", "100mbit", "none"]
    # bf16 is put first whatever the order asked: it is the reference of every ratio
    assert suite.parse_args(["--configs", "lynx-full", "bf16"]).configs == ["bf16", "lynx-full"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--configs", "lynx-full"], "must include bf16"),
        (["--gen", "64"], "at least 128"),
        (["--loads", "0"], "positive"),
        (["--configs", "nope"], "invalid choice"),
        (["--resummarize", "/nonexistent"], "no suite.json or suite-raw.json there"),
        (["--resummarize", "/nonexistent", "--models", "smollm2"], "it takes no plan"),
        (["--resummarize", "/nonexistent", "--quick"], "it takes no plan"),
    ],
)
def test_plan_errors_exit_2(
    suite: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        suite.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_upstream_error_is_the_last_error_line(suite: ModuleType) -> None:
    tail = "pair did not start; log x:\nINFO load\nValueError: fp8_e4m3 needs AMX\n  at line 3\nINFO exiting"
    assert suite.upstream_error(tail) == "ValueError: fp8_e4m3 needs AMX"
    assert suite.upstream_error("only this") == "only this"


def test_retrieval_items_plant_the_passcode_at_each_depth(suite: ModuleType, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    passages = [tokenizer("All work and no play makes Jack a dull boy. " * 400).input_ids]
    items = suite.retrieval_items(tokenizer, passages, [1024, 2048], [0.1, 0.9], seed=7)
    assert [(i.context, i.depth) for i in items] == [(1024, 0.1), (1024, 0.9), (2048, 0.1), (2048, 0.9)]
    assert len({i.passcode for i in items}) == 4
    for item in items:
        n = len(tokenizer(item.prompt).input_ids)
        assert item.context - 80 <= n <= item.context, (item.context, n)
        where = item.prompt.index(f"passcode is {item.passcode}") / item.prompt.index(
            suite.RETRIEVAL_QUESTION
        )
        assert abs(where - item.depth) < 0.05, (where, item.depth)
        assert item.correct(f" {item.passcode}") and not item.correct("000000")
    assert suite.retrieval_items(tokenizer, passages, [1024], [0.5], seed=7)[0].passcode == items[0].passcode
    with pytest.raises(SystemExit, match="too short"):
        suite.retrieval_items(tokenizer, passages, [100_000], [0.5], seed=7)


def _run(ttft: float, per_token: float, gen: int, lynx: dict | None, output: list[int] | None = None) -> dict:
    run = {"prompt_tokens": 100, "token_times": [ttft + per_token * i for i in range(gen)], "lynx": lynx}
    return run if output is None else {**run, "output_ids": output}


def _results(suite: ModuleType) -> dict:
    """bf16 at 0.1 s per token, speculative at 0.2 (its host slowed down), fp8 refused."""
    lynx = {
        "anchor_bytes": 600,
        "residual_bytes": 400,
        "anchor_latency_s": 0.5,
        "residual_latency_s": 1.5,
        "speculation": {"held": 4, "accepted": 3},
    }
    bf16_runs = [_run(2.0, 0.1, 128, None, [5, 6]), _run(2.0, 0.1, 128, None, [5, 7])]
    bf16 = suite.ConfigResult("bf16", latency={"20mbit": {"512": bf16_runs}})
    bf16.agreement_outputs = [[1, 2, 3], [4, 5, 6]]
    bf16.accuracy = [{"correct": True, "output_ids": [7]}, {"correct": False, "output_ids": [8]}]
    bf16.load = {"2": [{**_run(1.0, 0.1, 32, None), "sent_s": 0.0, "done_s": 4.0}] * 2}
    spec_runs = [_run(1.0, 0.2, 128, lynx, [5, 6]), _run(1.0, 0.2, 128, lynx, [5, 8])]
    spec = suite.ConfigResult("lynx-speculative", latency={"20mbit": {"512": spec_runs}})
    spec.agreement_outputs = [[1, 2, 3], [4, 9, 6]]
    spec.accuracy = [{"correct": True, "output_ids": [7]}, {"correct": True, "output_ids": [9]}]
    fp8 = suite.ConfigResult("fp8", error="ValueError: no AMX")
    return {"bf16": bf16, "fp8": fp8, "lynx-speculative": spec}


def test_summarize_turns_runs_into_rows_with_ratios_agreement_and_load(suite: ModuleType) -> None:
    summary = suite.summarize("m", _results(suite), bf16_per_token=10.0)
    rows = {r["config"]: r for r in summary["rows"]}
    assert rows["fp8"]["error"] == "ValueError: no AMX" and "points" not in rows["fp8"]
    point = rows["lynx-speculative"]["points"]["20mbit/512"]
    assert point["ttft"]["median"] == 1.0 and point["t32"]["median"] == pytest.approx(1.0 + 6.2)
    assert point["e2e"]["median"] == pytest.approx(1.0 + 25.4)
    assert point["decode_pace_s"]["median"] == pytest.approx(0.2)
    assert rows["bf16"]["points"]["20mbit/512"]["decode_pace_s"]["median"] == pytest.approx(0.1)
    assert point["kv_bytes"] == 1000 and rows["bf16"]["points"]["20mbit/512"]["kv_bytes"] == 1000
    assert point["held"] == 8 and point["accepted"] == 6 and point["anchor_landed_s"]["median"] == 0.5
    assert len(point["curve"]) == 128
    assert rows["lynx-speculative"]["agreement"] == {
        "identical_outputs": 0.5,
        "tokens_before_first_difference": pytest.approx(4 / 6),
    }
    assert (
        rows["lynx-speculative"]["accuracy"] == 1.0
        and rows["lynx-speculative"]["accuracy_equal_to_bf16"] == 1
    )
    # the timed requests' outputs, prompt by prompt and link by link: one of two equal
    assert rows["lynx-speculative"]["latency_outputs_equal_to_bf16"] == [1, 2]
    load = rows["bf16"]["load"]["2"]
    assert load["ttft_p50"] == 1.0 and load["tokens_per_s"] == pytest.approx(2 * 32 / 4.0)
    assert load["anchor_p50"] is None


def test_transfer_regimes_place_each_shaped_point_by_plain_pds_transfer_over_prefill(
    suite: ModuleType,
) -> None:
    assert suite.link_bits_per_s("20mbit") == 20e6 and suite.link_bits_per_s("1gbit") == 1e9
    assert suite.link_bits_per_s("none") is None
    point = {"kv_bytes": 2.5e6, "ttft": {"median": 3.0}}  # 1 s on 20 Mbit/s
    regimes = suite.transfer_regimes({"points": {"20mbit/512": point}})
    assert regimes == {"20mbit/512": {"transfer_s": 1.0, "prefill_s": 2.0, "transfer_over_prefill": 0.5}}
    # with the unshaped link's TTFT at the same context, that is the prefill time
    unshaped = {"kv_bytes": 2.5e6, "ttft": {"median": 1.6}}
    regimes = suite.transfer_regimes({"points": {"20mbit/512": point, "none/512": unshaped}})
    assert regimes["20mbit/512"]["prefill_s"] == 1.6 and list(regimes) == ["20mbit/512"]
    summary = suite.summarize("m", _results(suite), bf16_per_token=10.0)
    assert summary["regimes"]["20mbit/512"]["transfer_s"] == pytest.approx(1000 * 8 / 20e6)


def test_decode_pace_is_the_second_halfs_median_gap(suite: ModuleType) -> None:
    # a burst of committed tokens early on (speculation) does not move it
    times = [1.0, 5.0, 5.0, 5.0, 5.5, 6.0, 6.5, 7.0]
    assert suite.decode_pace(times) == pytest.approx(0.5)


def test_resummarize_rebuilds_a_runs_summaries_tables_and_plots_from_its_raw_runs(
    suite: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    from dataclasses import asdict

    results = _results(suite)
    plan = {
        "links": ["20mbit"],
        "contexts": [512],
        "prompts": 2,
        "load_context": 512,
        "load_link": "100mbit",
    }
    stale = {"model": "m", "rows": [], "bf16_bytes_per_token": 10.0, "served_contexts": {"512": 512}}
    report = {"command": ["suite.py"], "machine": {"cpus": 2}, "plan": plan, "wall_s": 60.0}
    report["summaries"] = [stale]
    (tmp_path / "suite.json").write_text(json.dumps(report))
    (tmp_path / "suite-raw.json").write_text(json.dumps({"m": {c: asdict(r) for c, r in results.items()}}))
    assert suite.main(["--resummarize", str(tmp_path)]) == 0
    rewritten = json.loads((tmp_path / "suite.json").read_text())
    kept = ("command", "machine", "plan", "wall_s")
    assert {k: rewritten[k] for k in kept} == {k: report[k] for k in kept}
    [summary] = rewritten["summaries"]
    assert summary["served_contexts"] == {"512": 512}
    rows = {r["config"]: r for r in summary["rows"]}
    assert rows["lynx-speculative"]["points"]["20mbit/512"]["decode_pace_s"]["median"] == pytest.approx(0.2)
    out = capsys.readouterr().out
    assert "| decode s/token |" in out and "| 8/6 | 0.200 |" in out
    assert "20mbit link, 512-token prompts (plain PD: transfer 0.0 s / prefill 2.0 s = 0.00)" in out
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "m-bits-bytes.png",
        "m-load.png",
        "m-regime.png",
        "m-tokens.png",
        "m-ttft.png",
    ]


def test_fetch_texts_downloads_nothing_when_the_texts_are_there(tmp_path: Path, monkeypatch) -> None:
    import bench_texts

    for name in bench_texts.TEXTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("text")

    def no_download(*args, **kwargs):
        raise AssertionError(f"nothing to fetch, yet it ran {args}")

    monkeypatch.setattr(bench_texts.subprocess, "run", no_download)
    bench_texts.fetch_texts(tmp_path)
