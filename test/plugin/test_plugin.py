"""The plugin as SGLang loads it: entry point, hooks applied, flags parsed and refused.

Each check runs SGLang in a fresh interpreter, as the launcher does, so the hooks never
leak into the test process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from probes import CPU_ENV, HERE, run_probe

LYNX_FLAGS = [
    "--lynx",
    "--lynx-mode",
    "--lynx-anchor-bits",
    "--lynx-group-size",
    "--lynx-residual",
    "--lynx-key-layout",
    "--lynx-key-block",
    "--lynx-protect-first",
    "--lynx-protect-last",
    "--lynx-max-speculative-tokens",
    "--lynx-verify-tolerance",
    "--lynx-verify-pass",
    "--lynx-lane-chunk-bytes",
    "--lynx-transfer-deadline",
    "--lynx-buffer-bytes",
    "--lynx-anchor-hold",
    "--lynx-residual-hold",
    "--lynx-auth-key-file",
]


def test_entry_point_is_registered() -> None:
    (plugin,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "lynx"]
    assert plugin.value == "lynx_patches:register"
    assert callable(plugin.load())


@pytest.fixture(scope="module")
def probe(tiny_model: Path) -> dict:
    model = ["--model-path", str(tiny_model)]
    pd = ["--disaggregation-transfer-backend", "mooncake_tcp"]
    cases = {
        "plain": model,
        "prefill_lynx": [
            *model,
            *pd,
            "--disaggregation-mode",
            "prefill",
            "--lynx",
            "--lynx-anchor-bits",
            "3",
            "--lynx-lane-chunk-bytes",
            "512KiB",
        ],
        "decode_plain": [*model, *pd, "--disaggregation-mode", "decode"],
        "lynx_without_pd": [*model, "--lynx"],
        "lynx_nixl": [
            *model,
            "--disaggregation-mode",
            "decode",
            "--disaggregation-transfer-backend",
            "nixl",
            "--lynx",
        ],
        "bits_5": [*model, *pd, "--disaggregation-mode", "decode", "--lynx", "--lynx-anchor-bits", "5"],
        "option_without_lynx": [*model, *pd, "--disaggregation-mode", "decode", "--lynx-residual", "exact"],
        "speculative_dp_attention": [
            *model,
            *pd,
            "--disaggregation-mode",
            "decode",
            "--lynx",
            "--lynx-mode=speculative",
            "--attn-dp-size",
            "2",
        ],
        "upstream_kv_checksum": [
            *model,
            *pd,
            "--disaggregation-mode",
            "prefill",
            "--lynx",
            "--disaggregation-enable-kv-checksum",
        ],
        "speculative_radix_cache": [
            *model,
            *pd,
            "--disaggregation-mode",
            "decode",
            "--lynx",
            "--lynx-mode=speculative",
            "--disaggregation-decode-enable-radix-cache",
        ],
        "infinite_deadline": [
            *model,
            *pd,
            "--disaggregation-mode",
            "decode",
            "--lynx",
            "--lynx-transfer-deadline",
            "inf",
        ],
        "tiny_deadline": [
            *model,
            *pd,
            "--disaggregation-mode",
            "decode",
            "--lynx",
            "--lynx-transfer-deadline",
            "1e-300",
        ],
        "huge_buffer": [
            *model,
            *pd,
            "--disaggregation-mode",
            "prefill",
            "--lynx",
            "--lynx-buffer-bytes",
            "99999999999G",
        ],
        "hold_past_deadline": [
            *model,
            *pd,
            "--disaggregation-mode",
            "prefill",
            "--lynx",
            "--lynx-residual-hold",
            "90",
        ],
        "missing_key_file": [
            *model,
            *pd,
            "--disaggregation-mode",
            "decode",
            "--lynx",
            "--lynx-auth-key-file",
            "/nonexistent/lynx.key",
        ],
        "decode_host_pool": [
            *model,
            *pd,
            "--disaggregation-mode",
            "decode",
            "--disaggregation-decode-retraction-backup",
            "host_pool",
        ],
    }
    return run_probe("probe_server_args.py", json.dumps(cases))


def test_every_hook_target_was_applied(probe: dict) -> None:
    # HookRegistry logs and skips a target it cannot resolve; after a SGLang bump that
    # would silently switch Lynx off, so each registered target must show up as patched.
    import lynx_patches.disaggregation_decode as decode
    import lynx_patches.output_streamer as output_streamer
    import lynx_patches.schedule_batch as schedule_batch

    registered = set(probe["registered"])
    assert registered <= set(probe["patched"]), registered - set(probe["patched"])
    for target in (
        decode.PROCESS_DECODE_QUEUE,
        decode.COMMIT,
        output_streamer.STREAMER + ".stream_output",
        schedule_batch.UPDATE_FINISH_STATE,
    ):
        assert "sglang.srt." + target in registered
    table = (HERE.parents[1] / "docs" / "hooks.md").read_text()
    missing = [t for t in registered if "`" + t.removeprefix("sglang.srt.") + "`" not in table]
    assert not missing, f"hook targets missing from docs/hooks.md: {missing}"


def test_lynx_swaps_in_its_mooncake_classes_only_with_lynx(probe: dict) -> None:
    assert probe["kv_classes_plain"] == {
        "manager": "MooncakeKVManager",
        "sender": "MooncakeKVSender",
        "receiver": "MooncakeKVReceiver",
    }
    assert probe["kv_classes_lynx"] == {
        "manager": "LynxKVManager",
        "sender": "LynxKVSender",
        "receiver": "LynxKVReceiver",
    }


def test_lynx_settings_are_published(probe: dict) -> None:
    case = probe["cases"]["prefill_lynx"]
    assert case["lynx"]["anchor_bits"] == 3
    assert case["lynx"]["lane_chunk_bytes"] == 512 * 1024
    assert case["lynx"]["mode"] == "full"


def test_without_lynx_nothing_is_published(probe: dict) -> None:
    assert probe["cases"]["plain"]["lynx"] is None
    assert probe["cases"]["decode_plain"]["lynx"] is None


def test_cpu_engine_pd_defaults(probe: dict) -> None:
    decode = probe["cases"]["decode_plain"]
    assert decode["retraction_backup"] == "cpu_tensor"
    assert decode["host_ip"] == "127.0.0.1"
    assert probe["cases"]["plain"]["retraction_backup"] is None


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("lynx_without_pd", "--lynx needs a prefill/decode disaggregated server"),
        ("lynx_nixl", "--disaggregation-transfer-backend mooncake or mooncake_tcp (got 'nixl')"),
        ("bits_5", "--lynx-anchor-bits must be 2, 3 or 4"),
        ("option_without_lynx", "--lynx-residual given without --lynx"),
        ("decode_host_pool", "use cpu_tensor"),
        ("speculative_dp_attention", "cannot run with data-parallel attention"),
        ("hold_past_deadline", "--lynx-residual-hold must be >= 0 and below --lynx-transfer-deadline"),
        ("upstream_kv_checksum", "--disaggregation-enable-kv-checksum compares prefill's KV"),
        ("speculative_radix_cache", "cannot run with --disaggregation-decode-enable-radix-cache"),
        ("infinite_deadline", "--lynx-transfer-deadline must be in [0.1, 3600] seconds, got inf"),
        ("tiny_deadline", "--lynx-transfer-deadline must be in [0.1, 3600] seconds, got 1e-300"),
        (
            "missing_key_file",
            "--lynx-auth-key-file /nonexistent/lynx.key: cannot read it (No such file or directory)",
        ),
        (
            "huge_buffer",
            "--lynx-buffer-bytes must be in 0..1099511627776 bytes (1TiB), got 107374182398926258176",
        ),
    ],
)
def test_bad_combinations_are_refused(probe: dict, case: str, message: str) -> None:
    error = probe["cases"][case].get("error", "")
    assert error.startswith("sglang-lynx: error: ")
    assert message in error


def test_the_auth_key_file_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from lynx_patches.server_args import settings_from_namespace

    monkeypatch.setenv("LYNX_AUTH_KEY_FILE", "/etc/lynx/env.key")
    by_env = settings_from_namespace(argparse.Namespace(lynx=True))
    assert by_env is not None and by_env.auth_key_file == "/etc/lynx/env.key"
    by_flag = settings_from_namespace(argparse.Namespace(lynx=True, lynx_auth_key_file="/etc/lynx/flag.key"))
    assert by_flag is not None and by_flag.auth_key_file == "/etc/lynx/flag.key"
    assert settings_from_namespace(argparse.Namespace(lynx=False)) is None  # no --lynx: not read


def test_launcher_help_lists_the_lynx_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        env=CPU_ENV,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in LYNX_FLAGS:
        assert f"{flag} " in out.stdout or f"{flag}\n" in out.stdout, flag


def test_launcher_exits_with_the_message(tiny_model: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_model), "--lynx"],
        capture_output=True,
        text=True,
        env=CPU_ENV,
        timeout=600,
    )
    assert out.returncode == 1
    assert "sglang-lynx: error: --lynx needs a prefill/decode disaggregated server" in out.stderr
