import json
import os
import threading
from pathlib import Path

import pytest

from lynx import settings
from lynx.settings import LynxSettings, LynxSettingsError
from lynx.transfer.auth import AuthKey


def test_defaults_are_valid_and_round_trip_through_json() -> None:
    original = LynxSettings(mode="anchor-only", anchor_bits=3, residual="exact", lane_chunk_bytes=65536)
    assert LynxSettings.from_json(original.to_json()) == original


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"anchor_bits": 1}, "2, 3 or 4"),
        ({"anchor_bits": 5}, "2, 3 or 4"),
        ({"mode": "eager"}, "--lynx-mode"),
        ({"group_size": 24}, "--lynx-group-size must be a power of two"),
        ({"group_size": 0}, "--lynx-group-size must be a power of two"),
        ({"residual": "int4"}, "--lynx-residual"),
        ({"key_layout": "diagonal"}, "--lynx-key-layout"),
        ({"key_block": 3}, "--lynx-key-block"),
        ({"protect_first": -1}, "--lynx-protect-first must be a token count in 0..65536, got -1"),
        ({"protect_last": 65537}, "--lynx-protect-last must be a token count in 0..65536, got 65537"),
        ({"max_speculative_tokens": 0}, "--lynx-max-speculative-tokens must be in 1..1024, got 0"),
        ({"transfer_deadline_s": 0.0}, "--lynx-transfer-deadline"),
        (
            {"transfer_deadline_s": 1e-300},
            r"--lynx-transfer-deadline must be in \[0.1, 3600\] seconds, got 1e-300",
        ),
        (
            {"buffer_bytes": 99999999999 << 30},
            rf"--lynx-buffer-bytes must be in 0..1099511627776 bytes \(1TiB\), got {99999999999 << 30}$",
        ),
        ({"buffer_bytes": -1}, r"--lynx-buffer-bytes must be in 0..1099511627776 bytes \(1TiB\), got -1"),
        (
            {"draft_memory_bytes": (1 << 40) + 1},
            r"--lynx-draft-memory-bytes must be in 0..1099511627776 bytes \(1TiB\), got 1099511627777",
        ),
        (
            {"lane_chunk_bytes": 1 << 30},
            "--lynx-lane-chunk-bytes must be in 4096..16777216 bytes, got 1073741824",
        ),
        ({"lane_chunk_bytes": 100}, "--lynx-lane-chunk-bytes must be in 4096..16777216 bytes, got 100"),
        ({"max_speculative_tokens": 1025}, "--lynx-max-speculative-tokens must be in 1..1024, got 1025"),
        ({"checksums": "yes"}, "--lynx-checksums must be true or false, got 'yes'"),
        ({"verify_pass": "rows"}, "--lynx-verify-pass must be one of layers, steps, batched, got 'rows'"),
    ],
)
def test_invalid_values_name_their_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(LynxSettingsError, match=message):
        LynxSettings(**kwargs)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("protect_first", 1.5, "--lynx-protect-first must be an integer, got 1.5"),
        ("anchor_bits", True, "--lynx-anchor-bits must be an integer, got True"),
        ("buffer_bytes", "1GiB", "--lynx-buffer-bytes must be an integer, got '1GiB'"),
        ("checksums", 1, "--lynx-checksums must be true or false, got 1"),
        ("transfer_deadline_s", "60", "--lynx-transfer-deadline must be a number, got '60'"),
        ("residual_hold_s", False, "--lynx-residual-hold must be a number, got False"),
        ("verify_pass", 2, "--lynx-verify-pass must be text, got 2"),
        ("mode", None, "--lynx-mode must be text, got None"),
        ("residual", ["exact"], r"--lynx-residual must be text, got \['exact'\]"),
    ],
)
def test_from_json_checks_each_setting_s_type(field: str, value: object, message: str) -> None:
    """Old: from_json passed any JSON value on (protect_first 1.5 was taken)."""
    raw = json.loads(LynxSettings().to_json())
    with pytest.raises(LynxSettingsError, match=message):
        LynxSettings.from_json(json.dumps({**raw, field: value}))


def test_numbers_may_be_written_as_integers() -> None:
    assert LynxSettings.from_json('{"transfer_deadline_s": 30}').transfer_deadline_s == 30
    assert LynxSettings(buffer_bytes=1 << 40, lane_chunk_bytes=16 << 20, max_speculative_tokens=1024)


def test_protected_tokens_are_counted_from_zero_to_the_bound() -> None:
    assert (LynxSettings().protect_first, LynxSettings().protect_last) == (0, 0)
    widest = LynxSettings(protect_first=65536, protect_last=65536)
    assert LynxSettings.from_json(widest.to_json()) == widest


def test_checksums_are_on_unless_switched_off() -> None:
    assert LynxSettings().checksums is True
    unchecked = LynxSettings(checksums=False)
    assert LynxSettings.from_json(unchecked.to_json()) == unchecked
    assert [settings.parse_switch(t) for t in ("on", "OFF", "true", "0")] == [True, False, True, False]
    with pytest.raises(ValueError, match="not on or off"):
        settings.parse_switch("maybe")


def test_from_json_rejects_unknown_and_malformed_settings() -> None:
    with pytest.raises(LynxSettingsError, match="unknown settings"):
        LynxSettings.from_json(json.dumps({"anchor_bits": 4, "colour": "red"}))
    with pytest.raises(LynxSettingsError, match="not valid JSON"):
        LynxSettings.from_json("{")
    with pytest.raises(LynxSettingsError, match="JSON object"):
        LynxSettings.from_json("[4]")


def test_publish_and_current_use_the_environment() -> None:
    env: dict[str, str] = {}
    assert settings.current(env) is None
    settings.publish(LynxSettings(anchor_bits=2), env)
    assert settings.current(env) == LynxSettings(anchor_bits=2)
    settings.publish(None, env)
    assert settings.SETTINGS_ENV not in env


def test_current_parses_the_environment_once_per_value(monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    settings.publish(LynxSettings(anchor_bits=3), env)
    parses = []
    real = LynxSettings.from_json

    def counted(text: str) -> LynxSettings:
        parses.append(text)
        return real(text)

    monkeypatch.setattr(LynxSettings, "from_json", staticmethod(counted))
    first = settings.current(env)
    assert all(settings.current(env) is first for _ in range(100))
    assert len(parses) == 1
    settings.publish(LynxSettings(anchor_bits=2), env)  # other settings: read anew
    assert settings.current(env) == LynxSettings(anchor_bits=2) and len(parses) == 2


def test_codec_config_carries_the_codec_fields() -> None:
    config = LynxSettings(anchor_bits=2, key_layout="per_token", key_block=32).codec_config()
    assert (config.anchor_bits, config.key_layout, config.key_block) == (2, "per_token", 32)


def test_flag_names() -> None:
    assert settings.flag_of("key_block") == "--lynx-key-block"
    assert settings.flag_of("transfer_deadline_s") == "--lynx-transfer-deadline"
    assert settings.flag_of("auth_key_file") == "--lynx-auth-key-file"


def key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "lynx.key"
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def test_the_auth_key_is_read_from_its_file_and_never_travels_in_the_settings(tmp_path: Path) -> None:
    secret = b"k" * 31 + b"!"
    assert LynxSettings().auth_key() is None
    keyed = LynxSettings(auth_key_file=key_file(tmp_path, secret + b"\n", 0o640))
    key = keyed.auth_key()
    assert key is not None and key.key_id == AuthKey(secret).key_id  # the newline is not the key's
    assert LynxSettings.from_json(keyed.to_json()) == keyed
    assert json.loads(keyed.to_json())["auth_key_file"] == str(tmp_path / "lynx.key")
    assert secret.decode() not in keyed.to_json() and secret.decode() not in repr(key)
    with pytest.raises(LynxSettingsError, match=r"^--lynx-auth-key-file /dev/null: not a regular file$"):
        LynxSettings(auth_key_file="/dev/null").auth_key()


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        (None, 0o600, "cannot read it (No such file or directory)"),
        (b"", 0o600, "a key is 16..4096 bytes, the file holds 0 (not counting surrounding whitespace)"),
        (b" short key \n", 0o600, "the file holds 9"),
        (b"x" * 4097, 0o600, "the file holds 4097"),
        # whitespace at the limit used to cut the file there, taking its first 4,096 bytes
        (b"x" * 4096 + b" " + b"y" * 100, 0o600, "the file holds 4197"),
        (b"x" * 32 + b" " * 8192, 0o600, "the file is over 8192 bytes"),
        (b"k" * 32, 0o644, "other users may read or write it (mode 644); chmod o-rwx "),
        (b"k" * 32, 0o602, "other users may read or write it (mode 602)"),
    ],
)
def test_a_bad_auth_key_file_is_refused_naming_the_flag(
    tmp_path: Path, content: bytes | None, mode: int, message: str
) -> None:
    path = str(tmp_path / "missing.key") if content is None else key_file(tmp_path, content, mode)
    with pytest.raises(LynxSettingsError) as caught:
        LynxSettings(auth_key_file=path).auth_key()
    assert str(caught.value).startswith(f"--lynx-auth-key-file {path}: ")
    assert message in str(caught.value)


def test_a_fifo_as_the_auth_key_file_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "lynx.key"
    os.mkfifo(path, 0o600)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            LynxSettings(auth_key_file=str(path)).auth_key()
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5.0)
    if reader.is_alive():  # unblock the reader so the test run does not hang with it
        with open(path, "wb"):
            pass
        pytest.fail("reading a FIFO key file waited for a writer")
    assert isinstance(outcome[0], LynxSettingsError)
    assert str(outcome[0]) == f"--lynx-auth-key-file {path}: not a regular file"


@pytest.mark.parametrize(
    ("text", "value"), [("65536", 65536), ("512KiB", 512 << 10), ("1MiB", 1 << 20), ("2m", 2 << 20)]
)
def test_parse_size(text: str, value: int) -> None:
    assert settings.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "1.5MiB", "-4", "3 parsecs"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        settings.parse_size(text)


@pytest.mark.parametrize(
    ("mode", "backend", "message"),
    [
        ("null", "mooncake", "--disaggregation-mode"),
        ("prefill", "nixl", "mooncake or mooncake_tcp"),
        ("decode", "fake", "mooncake or mooncake_tcp"),
    ],
)
def test_server_compatibility(mode: str, backend: str, message: str) -> None:
    with pytest.raises(LynxSettingsError, match=message):
        settings.check_server_compatibility(
            LynxSettings(), disaggregation_mode=mode, transfer_backend=backend
        )
    settings.check_server_compatibility(
        LynxSettings(), disaggregation_mode="decode", transfer_backend="mooncake_tcp"
    )


def test_speculative_decode_refuses_data_parallel_attention() -> None:
    spec = LynxSettings(mode="speculative")
    settings.check_server_compatibility(spec, disaggregation_mode="decode", transfer_backend="mooncake_tcp")
    with pytest.raises(LynxSettingsError, match="data-parallel attention"):
        settings.check_server_compatibility(
            spec, disaggregation_mode="decode", transfer_backend="mooncake_tcp", attn_dp_size=2
        )
    # prefill only sends both streams: its scheduler is not involved
    settings.check_server_compatibility(
        spec, disaggregation_mode="prefill", transfer_backend="mooncake_tcp", attn_dp_size=2
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE"),
        ({"decode_radix_cache": True}, "--disaggregation-decode-enable-radix-cache"),
    ],
)
def test_speculative_decode_refuses_what_would_share_or_roll_back_its_kv(extra: dict, message: str) -> None:
    spec = LynxSettings(mode="speculative")
    common = dict(disaggregation_mode="decode", transfer_backend="mooncake_tcp")
    with pytest.raises(LynxSettingsError, match=message):
        settings.check_server_compatibility(spec, **common, **extra)
    # full mode never holds Anchor-precision KV in a running request
    settings.check_server_compatibility(LynxSettings(), **common, **extra)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_upstream_kv_checksum_is_refused_naming_lynx_checksums(mode: str) -> None:
    with pytest.raises(LynxSettingsError, match=r"--disaggregation-enable-kv-checksum.*own checksum"):
        settings.check_server_compatibility(
            LynxSettings(), disaggregation_mode=mode, transfer_backend="mooncake_tcp", kv_checksum=True
        )


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 0.0, 0.099, 3601.0])
def test_transfer_deadline_is_finite_and_bounded(seconds: float) -> None:
    with pytest.raises(LynxSettingsError, match=r"--lynx-transfer-deadline must be in \[0.1, 3600\]"):
        LynxSettings(transfer_deadline_s=seconds)
    assert LynxSettings(transfer_deadline_s=3600).transfer_deadline_s == 3600
    assert LynxSettings(transfer_deadline_s=0.1).transfer_deadline_s == 0.1
