"""``lynx.tools.gpu_check`` and ``scripts/gpu_check.sh`` without a GPU: argument handling,
``--plan`` (touching no CUDA device), the JSON report, the no-CUDA path, and the pieces of
each step that need no device (peak table, transport choice, the pytest verdict, bytes
moved, output comparison, the server command lines, the CPU half of the byte comparison).
The steps themselves run on a CUDA host only; nothing here pretends to run them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lynx.codec import CodecConfig, KVLayout
from lynx.tools import codec_bench
from lynx.tools.gpu_check import (
    STEPS,
    Answer,
    Context,
    Peak,
    StepResult,
    TransferUnavailable,
    compare_outputs,
    compare_paths,
    evaluate_pd,
    fraction_text,
    main,
    moved_nbytes,
    parse_args,
    peak_bandwidth,
    pytest_outcome,
    resolve_transfer,
    runner,
    server_commands,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _no_cuda_please(*_args: object, **_kwargs: object) -> None:
    raise AssertionError("--plan touched CUDA")


def _report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ---- --plan and the JSON report --------------------------------------------------------


def test_plan_describes_every_step_as_json_without_touching_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("is_available", "device_count", "get_device_name", "get_device_properties", "init"):
        monkeypatch.setattr(torch.cuda, name, _no_cuda_please)
    monkeypatch.setattr(runner, "cuda_device", _no_cuda_please)
    out = tmp_path / "deep" / "plan.json"
    assert main(["--plan", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = _report(out)
    assert out.read_text().strip() in printed  # printed as well as written
    assert report["tool"] == "lynx.tools.gpu_check" and report["schema"] == 1
    assert report["plan"] is True and report["ok"] is True and report["exit_code"] == 0
    assert report["device"] == {"name": None, "probed": False, "peak_gbps": None, "peak_source": "unknown"}
    assert [step["name"] for step in report["steps"]] == list(STEPS)
    for step in report["steps"]:
        assert step["status"] == "planned" and step["reason"] == "--plan: not run", step
        assert step["details"] and len(step["items"]) == 1
        assert f"| {step['name']} | {step['items'][0]['name']} | planned |" in printed
    steps = {step["name"]: step["details"] for step in report["steps"]}
    assert steps["codec"]["command"][-3:] == [
        "test/unit/test_codec_triton.py",
        "test/unit/test_codec_lossless_cuda.py",
        "test/unit/test_sender_layers_cuda.py",
    ]
    assert steps["codec"]["test_files_found"] is True and steps["codec"]["cwd"] == str(ROOT)
    assert steps["bytes"]["modes"] == list(codec_bench.MODES)
    assert steps["bytes"]["paths"] == ["cpu-torch", "cpu-cpp", "triton"]
    assert steps["throughput"]["peak_gbps"] == "from the device name at run time"
    commands = steps["pd"]["commands"]
    assert set(commands) == {"plain", "full", "speculative"}
    backend = steps["pd"]["transfer"]["backend"]
    for config, sides in commands.items():
        assert set(sides) == {"prefill", "decode"}
        for side, command in sides.items():
            assert " -m sglang.launch_server " in command
            assert "--mem-fraction-static 0.35" in command
            assert f"--disaggregation-transfer-backend {backend} " in command
            assert f"--disaggregation-mode {side}" in command
            assert "--device cpu" not in command  # CUDA servers
            assert ("--lynx" in command) == (config != "plain")
    assert (
        "--lynx-mode speculative --lynx-residual exact --lynx-residual-hold 0.5"
        in commands["speculative"]["decode"]
    )
    assert "--lynx-mode full --lynx-residual exact --disaggregation" in commands["full"]["prefill"]


def test_plan_reports_unselected_steps_as_skipped_and_takes_the_peak_override(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main(["--plan", "--steps", "pd,codec,pd", "--peak-gbps", "1234.5", "--out", str(out)]) == 0
    report = _report(out)
    statuses = {step["name"]: (step["status"], step["reason"]) for step in report["steps"]}
    assert statuses == {
        "codec": ("planned", "--plan: not run"),
        "bytes": ("skipped", "not selected (--steps)"),
        "throughput": ("skipped", "not selected (--steps)"),
        "pd": ("planned", "--plan: not run"),
    }
    assert report["options"]["steps"] == ["codec", "pd"]  # canonical order, once each
    assert report["device"]["peak_gbps"] == 1234.5 and report["device"]["peak_source"] == "--peak-gbps"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "codec,gpu"], "unknown step 'gpu'; choose from codec, bytes, throughput, pd"),
        (["--steps", " , "], "no step named"),
        (["--peak-gbps", "0"], "--peak-gbps: must be > 0"),
        (["--peak-gbps", "fast"], "expected a number, got 'fast'"),
        (["--repeats", "2.5"], "expected a whole number"),
        (["--mem-fraction-static", "0.6"], "each may take at most 0.5"),
        (["--prompts", "7"], "--prompts must be in 1..6"),
        (["--residual-hold", "-1"], "--residual-hold must be in [0, 60)"),
        (["--transfer", "tcp", "--ib-device", "mlx5_0"], "does not go with --transfer tcp"),
        (["--transfer", "infiniband"], "invalid choice: 'infiniband'"),
        (["--server-args", "--x 'open"], "--server-args: No closing quotation"),
        (["--model", "/nonexistent/model"], "not tiny, smollm2, or a model folder"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--plan", "--out", str(out)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_model_folder_is_needed_only_by_the_pd_step(tmp_path: Path) -> None:
    assert parse_args(["--steps", "bytes", "--model", "/nonexistent"]).model == "/nonexistent"
    (tmp_path / "config.json").write_text("{}")
    assert parse_args(["--model", str(tmp_path)]).model == str(tmp_path)
    assert parse_args(["--ib-device", "mlx5_0"]).transfer == "rdma"  # a device means RDMA


def test_without_cuda_every_step_is_skipped_and_the_exit_is_3(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "python")}
    run = subprocess.run(
        [sys.executable, "-m", "lynx.tools.gpu_check", "--steps", "codec,bytes,pd", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 3, run.stderr
    assert "gpu_check: no CUDA device: torch.cuda.is_available() is False" in run.stderr
    report = _report(out)
    assert report["ok"] is False and report["exit_code"] == 3 and report["plan"] is False
    assert report["device"]["probed"] is True and report["device"]["name"] is None
    statuses = {step["name"]: (step["status"], step["reason"]) for step in report["steps"]}
    assert statuses == {
        "codec": ("skipped", "no CUDA device"),
        "bytes": ("skipped", "no CUDA device"),
        "throughput": ("skipped", "not selected (--steps)"),
        "pd": ("skipped", "no CUDA device"),
    }
    assert "| codec | | skipped | no CUDA device |" in run.stdout


def test_a_step_that_raises_fails_alone_and_a_spent_budget_skips_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The runner's bookkeeping, with the device and the steps replaced: no real step runs.
    monkeypatch.setattr(runner, "cuda_device", lambda: {"name": "NVIDIA H200"})
    # The check unsets it (its kernels must not run in the interpreter); monkeypatch puts
    # back this process's value, which test_codec_triton.py may have set.
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def raises(ctx: Context) -> StepResult:
        raise RuntimeError("kernel launch failed\nsecond line")

    def passes_slowly(ctx: Context) -> StepResult:
        time.sleep(1.2)  # past the 1 s budget: the next step must not start
        return StepResult("bytes", "ok", "fine")

    registry = dict(runner.REGISTRY)
    registry["codec"] = dataclasses.replace(registry["codec"], run=raises)
    registry["bytes"] = dataclasses.replace(registry["bytes"], run=passes_slowly)
    registry["pd"] = dataclasses.replace(registry["pd"], run=_no_cuda_please)
    monkeypatch.setattr(runner, "REGISTRY", registry)
    out = tmp_path / "report.json"
    assert main(["--steps", "codec,bytes,pd", "--budget-s", "1", "--out", str(out)]) == 1
    assert "TRITON_INTERPRET" not in os.environ
    report = _report(out)
    steps = {step["name"]: step for step in report["steps"]}
    assert steps["codec"]["status"] == "failed"
    assert steps["codec"]["reason"] == "RuntimeError: kernel launch failed"
    assert "Traceback" in steps["codec"]["details"]["traceback"]
    assert steps["bytes"]["status"] == "ok" and steps["bytes"]["seconds"] >= 1.2
    assert (steps["pd"]["status"], steps["pd"]["reason"]) == (
        "skipped",
        "not started: time budget (--budget-s) spent",
    )
    assert report["device"]["peak_gbps"] == 4800.0 and report["device"]["peak_source"] == "table: H200"
    err = capsys.readouterr().err
    assert "not every step passed: codec (failed: RuntimeError: kernel launch failed)" in err
    assert "pd (skipped: not started" in err


# ---- the steps' device-free pieces -----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gbps"),
    [
        ("NVIDIA H200", 4800.0),
        ("NVIDIA H200 NVL", 4800.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 SXM5 80GB", 3350.0),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100 80GB PCIe", None),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA L40S", 864.0),
        ("NVIDIA L40", None),
        ("NVIDIA H20", None),
        ("Tesla T4", None),
        (None, None),
    ],
)
def test_peak_bandwidth_comes_from_the_table_of_known_gpus(name: str | None, gbps: float | None) -> None:
    peak = peak_bandwidth(name, None)
    assert peak.gbps == gbps
    assert (peak.source == "unknown") == (gbps is None)
    assert peak.source.startswith("table: ") == (gbps is not None)
    assert peak_bandwidth(name, 1000.0) == Peak(1000.0, "--peak-gbps")


def test_throughput_counts_bytes_read_and_written() -> None:
    assert moved_nbytes("encode", 1000, 300, 200) == 1500
    assert moved_nbytes("decode_anchor", 1000, 300, 200) == 1300
    assert moved_nbytes("decode_full", 1000, 300, 200) == 1500
    with pytest.raises(ValueError, match="unknown op"):
        moved_nbytes("decode", 1, 1, 1)
    assert fraction_text(1200.0, Peak(4800.0, "table: H200")) == "25% of peak"
    assert fraction_text(1200.0, Peak(None, "unknown")) == "peak unknown"


def test_transport_is_rdma_where_the_host_has_a_device_else_tcp(tmp_path: Path) -> None:
    none, some = tmp_path / "none", tmp_path / "some"
    none.mkdir()
    (some / "mlx5_1").mkdir(parents=True)
    (some / "mlx5_0").mkdir()
    tcp = resolve_transfer("auto", None, none)
    assert tcp.backend == "mooncake_tcp" and tcp.args == ("--disaggregation-transfer-backend", "mooncake_tcp")
    assert str(none) in tcp.why
    assert resolve_transfer("auto", None, tmp_path / "missing").backend == "mooncake_tcp"
    rdma = resolve_transfer("auto", None, some)
    assert rdma.args == ("--disaggregation-transfer-backend", "mooncake")
    assert rdma.why == "RDMA devices: mlx5_0, mlx5_1"
    assert resolve_transfer("tcp", None, some).backend == "mooncake_tcp"
    assert resolve_transfer("rdma", "mlx5_1", some).args[-2:] == ("--disaggregation-ib-device", "mlx5_1")
    with pytest.raises(TransferUnavailable, match="lists no device"):
        resolve_transfer("rdma", None, none)


@pytest.mark.parametrize(
    ("returncode", "stdout", "passed", "counts"),
    [
        (0, "........\n8 passed in 3.21s\n", True, {"passed": 8}),
        (0, "8 passed, 2 warnings in 1.00s", True, {"passed": 8}),
        (0, "7 passed, 1 skipped in 2.00s", False, {"passed": 7, "skipped": 1}),
        (1, "FAILED test_x\n1 failed, 7 passed in 2.00s", False, {"failed": 1, "passed": 7}),
        (2, "2 errors in 0.50s", False, {"errors": 2}),
        (5, "no tests ran in 0.01s", False, {}),
        (0, "", False, {}),
    ],
)
def test_the_codec_step_passes_only_when_every_test_ran_and_passed(
    returncode: int, stdout: str, passed: bool, counts: dict[str, int]
) -> None:
    ok, summary, found = pytest_outcome(returncode, stdout)
    assert (ok, found) == (passed, counts)
    assert summary == (stdout.strip().splitlines()[-1] if stdout else "(no output)")


def test_outputs_are_compared_token_for_token() -> None:
    result = compare_outputs(
        [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2]], [[1, 2, 3], [4, 0, 6], [7, 8], [1, 2]]
    )
    assert (result.equal, result.total) == (2, 4)
    assert result.first_difference == [None, 1, 2, None]
    with pytest.raises(ValueError, match="2 outputs for 1 reference"):
        compare_outputs([[1]], [[1], [1]])


def _answers(outputs: list[list[int]], lynx: bool, held: int = 0) -> list[Answer]:
    report = [{"anchor_bytes": 1, "speculation": {"held": held, "accepted": held - 1, "rejected": True}}]
    return [Answer(out, 0.01 * (i + 1), report if lynx else None) for i, out in enumerate(outputs)]


def test_pd_passes_only_when_lynx_equals_plain_pd_and_really_ran() -> None:
    options = parse_args(["--plan", "--prompts", "3", "--max-new-tokens", "2"])
    plain = [[1, 2], [3, 4], [5, 6]]
    answers = {
        "plain": _answers(plain, lynx=False),
        "full": _answers(plain, lynx=True),
        "speculative": _answers([[1, 2], [3, 9], [5, 6]], lynx=True, held=4),
    }
    items, configs = evaluate_pd(answers, {}, options)
    rows = {item.name: item for item in items}
    assert [rows[c].status for c in ("plain", "full", "speculative")] == ["ok", "ok", "failed"]
    assert rows["plain"].result == "TTFT median 20 ms"
    assert rows["full"].result == "3/3 equal to plain, TTFT median 20 ms"
    assert rows["speculative"].result == (
        "2/3 equal to plain, TTFT median 20 ms, 12 held / 9 accepted; 1 outputs differ from plain PD's"
    )
    assert configs["speculative"]["first_difference"] == [None, 1, None]
    assert configs["speculative"]["speculation"] == {"held": 12, "accepted": 9, "rejections": 3}
    assert configs["full"]["ttft_median_s"] == pytest.approx(0.02)

    # Lynx that did not run (no transfer report), no held token, short outputs, no reference
    broken = {
        "full": _answers(plain, lynx=False),
        "speculative": _answers([[1, 2], [3, 4], [5]], lynx=True, held=0),
    }
    items, _ = evaluate_pd(broken, {"plain": "ClusterError: prefill exited"}, options)
    rows = {item.name: item for item in items}
    assert (rows["plain"].status, rows["plain"].result) == ("failed", "ClusterError: prefill exited")
    assert "0/3 answers carry a Lynx transfer report" in rows["full"].result
    assert "no plain PD outputs to compare with" in rows["full"].result
    assert "1 outputs not 2 tokens long" in rows["speculative"].result
    assert "no token was held" in rows["speculative"].result
    assert all(item.status == "failed" for item in items)


def test_both_servers_of_a_configuration_get_the_same_lynx_flags(tmp_path: Path) -> None:
    options = parse_args(["--residual-hold", "0", "--server-args", "--attention-backend triton"])
    transfer = resolve_transfer("tcp", None)
    commands = server_commands(options, transfer, tmp_path)
    for config, sides in commands.items():
        lynx = {side: [arg for arg in argv if arg.startswith("--lynx")] for side, argv in sides.items()}
        assert lynx["prefill"] == lynx["decode"], config
        for argv in sides.values():
            assert argv[argv.index("--model-path") + 1] == str(tmp_path)
            assert argv[argv.index("--attention-backend") + 1] == "triton"
        assert "--disaggregation-bootstrap-port" in sides["prefill"]
        assert "--disaggregation-bootstrap-port" not in sides["decode"]
    assert "--lynx-residual-hold" not in commands["speculative"]["decode"]  # --residual-hold 0


# ---- the CPU half of the byte comparison (lynx.tools.codec_bench) ------------------------


def test_segment_digests_tell_paths_and_inputs_apart() -> None:
    layout = KVLayout(2, 2, 64, torch.bfloat16)
    config = codec_bench.MODES["b4 keys/ch16 int8"]
    with codec_bench.cpu_backend("reference"):
        first = codec_bench.make_segment(layout, 40, config, "cpu").digests()
        again = codec_bench.make_segment(layout, 40, config, "cpu").digests()
        other_seed = codec_bench.make_segment(layout, 40, config, "cpu", seed=1).digests()
        two_bit = codec_bench.make_segment(layout, 40, CodecConfig(anchor_bits=2), "cpu").digests()
    assert set(first) == {*codec_bench.DIGEST_PARTS, "all"}
    assert first == again
    assert codec_bench.differing_parts(first, other_seed) == list(codec_bench.DIGEST_PARTS)
    assert "anchor" in codec_bench.differing_parts(first, two_bit)
    assert compare_paths({"cpu-torch": first, "x": again, "y": two_bit})["x"] == []
    assert os.environ.get("LYNX_CODEC_BACKEND") is None  # restored


def test_the_cpp_codec_writes_the_references_bytes() -> None:
    from lynx.codec import cpp_backend

    if not cpp_backend.available():
        pytest.skip("the C++ codec is not built here")
    layout = KVLayout(2, 2, 64, torch.bfloat16)
    for name, config in codec_bench.MODES.items():
        digests = {}
        for path, backend in (("cpu-torch", "reference"), ("cpu-cpp", "cpp")):
            with codec_bench.cpu_backend(backend):
                digests[path] = codec_bench.make_segment(layout, 40, config, "cpu").digests()
        assert compare_paths(digests) == {"cpu-cpp": []}, name


# ---- scripts/gpu_check.sh --------------------------------------------------------------


def gpu_check_sh(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_script_says_how_it_is_used_and_refuses_bad_arguments(tmp_path: Path) -> None:
    helped = gpu_check_sh("--help")
    assert helped.returncode == 0, helped.stderr
    assert "scripts/gpu_check.sh [--venv DIR | --no-venv] [--no-install] [CHECK ARGS...]" in helped.stdout
    for wrong, message in (
        (("--venv",), "--venv needs a folder"),
        (("--venv", "x", "--no-venv"), "exclude each other"),
    ):
        out = gpu_check_sh(*wrong)
        assert out.returncode == 2 and message in out.stderr, (wrong, out)
    missing = gpu_check_sh("--venv", str(tmp_path / "none"), "--no-install", "--plan")
    assert missing.returncode == 1 and "no virtual environment at" in missing.stderr
    unknown = gpu_check_sh("--no-venv", "--no-install", "--steps", "nope")
    assert unknown.returncode == 2 and "unknown step 'nope'" in unknown.stderr


def test_the_script_hands_its_other_arguments_to_the_check(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    run = gpu_check_sh("--no-venv", "--no-install", "--plan", "--steps", "throughput", "--out", str(out))
    assert run.returncode == 0, run.stderr
    report = _report(out)
    assert report["plan"] is True and report["options"]["steps"] == ["throughput"]
    helped = gpu_check_sh("--no-venv", "--no-install", "--", "--help")
    assert helped.returncode == 0 and "--peak-gbps" in helped.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_script_is_shellcheck_clean() -> None:
    out = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout
