"""docker/compose.yaml and its overlays, checked without Docker (CI may have none): the
files' structure, and each service's command line parsed by upstream's own parsers with
the Lynx plugin loaded, so a flag typo in a compose file or docker/.env fails here, not in
a user's cluster. Where ``docker-compose`` is installed, its own validation runs too;
scripts/compose.sh's argument handling and shellcheck (where installed) as well. The full
build and run (scripts/compose.sh up, check, down) is not in CI."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from probes import HERE, run_probe

ROOT = HERE.parents[1]
COMPOSE = ROOT / "docker" / "compose.yaml"
OVERLAYS = {name: ROOT / "docker" / f"compose.{name}.yaml" for name in ("offline", "slowlink", "gpu")}
ENV_FILE = ROOT / "docker" / ".env"
COMPOSE_SH = ROOT / "scripts" / "compose.sh"
SERVERS = ("prefill", "decode")
# $$ (a literal $), ${NAME}, ${NAME:-default}, ${NAME-default}
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def env_file() -> dict[str, str]:
    pairs = {}
    for line in ENV_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            pairs[name.strip()] = value.strip()
    return pairs


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution, on every string of the parsed file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is None:
            raise KeyError(f"{name} is used in {COMPOSE.name} but set nowhere (not in {ENV_FILE.name})")
        return default

    return _VARIABLE.sub(substitute, value)


def services(env: dict[str, str] | None = None, path: Path = COMPOSE) -> dict[str, Any]:
    return interpolate(yaml.safe_load(path.read_text()), env or env_file())["services"]


def command(service: dict[str, Any]) -> list[str]:
    value = service["command"]
    return shlex.split(value) if isinstance(value, str) else list(value)


def test_only_the_router_is_published_and_servers_wait_for_each_other() -> None:
    svc = services()
    assert set(svc) == {"models", *SERVERS, "router"}
    assert [name for name, s in svc.items() if "ports" in s] == ["router"]
    assert svc["router"]["ports"] == ["127.0.0.1:8000:8000"]  # loopback unless ROUTER_BIND says
    images = {s["image"] for s in svc.values()}
    assert len(images) == 1, images  # one image: prefill and decode run the same Lynx
    for name in SERVERS:
        s = svc[name]
        assert s["depends_on"] == {"models": {"condition": "service_completed_successfully"}}
        assert "http://127.0.0.1:30000/health" in " ".join(s["healthcheck"]["test"])
        assert s["restart"] == "unless-stopped"
        assert s["ulimits"] == {"stack": 67108864} and s["ipc"] == "host"  # memlock: the GPU overlay
        assert "models:/models:ro" in s["volumes"]
    assert svc["router"]["depends_on"] == {n: {"condition": "service_healthy"} for n in SERVERS}
    assert svc["models"]["restart"] == "no" and "models:/models" in svc["models"]["volumes"]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
@pytest.mark.parametrize("overlay", [None, *OVERLAYS])
def test_docker_compose_accepts_the_file_and_each_overlay(overlay: str | None) -> None:
    files = ["-f", str(COMPOSE)] + (["-f", str(OVERLAYS[overlay])] if overlay else [])
    out = subprocess.run(
        ["docker-compose", *files, "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_the_offline_overlay_hands_the_models_service_the_hosts_wheels() -> None:
    from lynx.tools.models import WHEEL_DIR_ENV

    models = services(path=OVERLAYS["offline"])["models"]
    assert models["volumes"] == ["./.wheels:/wheels:ro"]  # docker/.wheels, where compose.sh downloads
    assert models["environment"] == {WHEEL_DIR_ENV: "/wheels"}


def test_the_slow_link_overlay_shapes_prefill_alone() -> None:
    overlay = services(path=OVERLAYS["slowlink"])
    assert set(overlay) == {"prefill"}
    prefill = overlay["prefill"]
    assert prefill["cap_add"] == ["NET_ADMIN"] and prefill["user"] == "root"  # tc, then setpriv to lynx
    assert prefill["environment"]["LYNX_LINK_RATE"] == env_file()["LYNX_LINK_RATE"] == "20mbit"
    entrypoint = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert 'tbf rate "$LYNX_LINK_RATE"' in entrypoint and "setpriv --reuid=lynx" in entrypoint


def test_the_gpu_overlay_reserves_one_gpu_per_server_and_swaps_the_image() -> None:
    overlay = services(path=OVERLAYS["gpu"])
    assert set(overlay) == {"models", *SERVERS, "router"}
    assert len({s["image"] for s in overlay.values()}) == 1
    assert all(
        s["build"]["args"] == {"BASE": "lmsysorg/sglang:v0.5.23", "EXTRA": "cuda"} for s in overlay.values()
    )
    gpus = []
    for name in SERVERS:
        (device,) = overlay[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        assert overlay[name]["environment"] == {"SGLANG_USE_CPU_ENGINE": "0"}
        assert overlay[name]["ulimits"]["memlock"] == -1  # RDMA memory registration
    assert gpus == ["0", "1"]


def server_argv(name: str, model: Path, env: dict[str, str] | None = None, path: Path = COMPOSE) -> list[str]:
    argv = command(services(env, path)[name])
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv
    return [str(model) if arg == "/models/current" else arg for arg in argv[3:]]


def test_server_command_lines_parse_with_upstream_and_the_plugin(tiny_model: Path) -> None:
    # argparse takes unambiguous prefixes (--lynx-mod), so the typo is not one
    typo = {**env_file(), "LYNX_ARGS": env_file()["LYNX_ARGS"].replace("--lynx-mode", "--lynx-moed")}
    cases = {name: server_argv(name, tiny_model) for name in SERVERS}
    cases["typo"] = server_argv("decode", tiny_model, typo)
    cases.update({f"gpu_{name}": server_argv(name, tiny_model, path=OVERLAYS["gpu"]) for name in SERVERS})
    result = run_probe("probe_server_args.py", json.dumps(cases))["cases"]
    prefill, decode = result["prefill"], result["decode"]
    assert "error" not in prefill and "error" not in decode, result
    assert prefill["lynx"] is not None and prefill["lynx"]["mode"] == "speculative"
    assert prefill["lynx"] == decode["lynx"]  # the same settings, or they would refuse to pair
    assert "error" in result["typo"], result["typo"]
    for name in SERVERS:  # on the GPU: the same Lynx settings, KV over Mooncake (RDMA where it can)
        assert result[f"gpu_{name}"].get("lynx") == prefill["lynx"], result[f"gpu_{name}"]
    assert command(services(path=OVERLAYS["gpu"])["decode"]).count("mooncake") == 1


def test_router_command_line_parses_with_the_routers_parser() -> None:
    from sglang_router.launch_router import parse_router_args

    argv = command(services()["router"])
    assert argv[:3] == ["python", "-m", "sglang_router.launch_router"], argv
    args = parse_router_args(argv[3:])
    assert args.pd_disaggregation
    assert [tuple(p) for p in args.prefill_urls] == [("http://prefill:30000", 8998)]
    assert list(args.decode_urls) == ["http://decode:30000"]
    bootstrap = command(services()["prefill"])
    assert bootstrap[bootstrap.index("--disaggregation-bootstrap-port") + 1] == "8998"


def compose_sh(*args: str) -> subprocess.CompletedProcess[str]:
    # Usage errors and help are answered before docker is looked for.
    return subprocess.run(["bash", str(COMPOSE_SH), *args], capture_output=True, text=True, timeout=60)


def test_compose_sh_says_how_it_is_used() -> None:
    helped = compose_sh("--help")
    assert helped.returncode == 0, helped.stderr
    for verb in ("up [--link RATE] [--online]", "check [--prompt TEXT]", "down [--volumes]"):
        assert f"scripts/compose.sh {verb}" in helped.stdout
    for wrong in ((), ("start",), ("up", "--link"), ("up", "--fast"), ("down", "--all")):
        out = compose_sh(*wrong)
        assert out.returncode == 2 and "scripts/compose.sh up" in out.stdout, (wrong, out)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_shell_scripts_are_shellcheck_clean() -> None:
    scripts = [COMPOSE_SH, ROOT / "docker" / "entrypoint.sh"]
    out = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout


def test_the_image_and_compose_sh_install_the_same_requirements() -> None:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "requirements.py"), "cpu", "models"],
        capture_output=True,
        text=True,
        check=True,
    )
    wanted = [*pyproject["build-system"]["requires"], *pyproject["project"]["dependencies"]]
    wanted += (
        pyproject["project"]["optional-dependencies"]["cpu"]
        + pyproject["project"]["optional-dependencies"]["models"]
    )
    assert out.stdout.split() == wanted
    assert "requirements.py" in (ROOT / "docker" / "Dockerfile").read_text()
    assert "docker/requirements.py cpu models" in COMPOSE_SH.read_text()
    unknown = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "requirements.py"), "gpu"], capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "no extra gpu" in unknown.stderr


def test_the_image_compiles_the_codec_in_a_build_stage_and_needs_it() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    build, final = dockerfile.split("FROM runtime AS build\n")[1].split("\nFROM runtime\n")
    assert "g++" in build and "--no-build-isolation" in build  # against the runtime stage's torch
    assert "g++" not in final and "cpp_backend.module()" in final  # no compiler; no image without it
    assert "COPY README.md setup.py" in build


def _codec_check(monkeypatch, capsys, backends: dict[str, str | None]) -> str:
    """Run compose.sh check's codec step (its Python, as the router's container would) against
    servers whose /server_info name ``backends``; its printed line."""
    import io
    import urllib.request

    script = COMPOSE_SH.read_text().split("codecs_compiled() {")[1]
    script = script.split("<<'EOF'\n")[1].split("\nEOF\n")[0]

    def urlopen(url: str, timeout: float) -> io.BytesIO:
        name = url.removeprefix("http://").split(":")[0]
        return io.BytesIO(json.dumps({"internal_states": [{"lynx_codec_backend": backends[name]}]}).encode())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    exec(compile(script, "codecs_compiled", "exec"), {})
    return capsys.readouterr().out.strip()


def test_compose_check_prints_the_codecs_and_fails_on_the_reference(monkeypatch, capsys) -> None:
    assert "codecs_compiled || die" in COMPOSE_SH.read_text()
    line = _codec_check(monkeypatch, capsys, {"prefill": "cpp", "decode": "cpp"})
    assert line == "Lynx codec: prefill cpp, decode cpp"
    with pytest.raises(SystemExit, match="torch reference codec") as exit_:
        _codec_check(monkeypatch, capsys, {"prefill": "cpp", "decode": "reference"})
    assert exit_.value.code != 0
    assert _codec_check(monkeypatch, capsys, {"prefill": None, "decode": None}).endswith("none (no --lynx)")
