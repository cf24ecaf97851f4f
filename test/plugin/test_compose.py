"""docker/compose.yaml, checked without Docker (CI has none): the file's structure, and
each service's command line parsed by upstream's own parsers with the Lynx plugin loaded,
so a flag typo in the compose file or docker/.env fails here, not in a user's cluster.
Where ``docker-compose`` is installed, its own validation runs too. The full build and
run is not in CI."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from probes import HERE, run_probe

ROOT = HERE.parents[1]
COMPOSE = ROOT / "docker" / "compose.yaml"
ENV_FILE = ROOT / "docker" / ".env"
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


def services(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env or env_file())["services"]


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
        assert s["ulimits"]["memlock"] == -1 and s["ipc"] == "host"
        assert "models:/models:ro" in s["volumes"]
    assert svc["router"]["depends_on"] == {n: {"condition": "service_healthy"} for n in SERVERS}
    assert svc["models"]["restart"] == "no" and "models:/models" in svc["models"]["volumes"]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_accepts_the_file() -> None:
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def server_argv(name: str, model: Path, env: dict[str, str] | None = None) -> list[str]:
    argv = command(services(env)[name])
    assert argv[:3] == ["python", "-m", "sglang.launch_server"], argv
    return [str(model) if arg == "/models/current" else arg for arg in argv[3:]]


def test_server_command_lines_parse_with_upstream_and_the_plugin(tiny_model: Path) -> None:
    # argparse takes unambiguous prefixes (--lynx-mod), so the typo is not one
    typo = {**env_file(), "LYNX_ARGS": env_file()["LYNX_ARGS"].replace("--lynx-mode", "--lynx-moed")}
    cases = {name: server_argv(name, tiny_model) for name in SERVERS}
    cases["typo"] = server_argv("decode", tiny_model, typo)
    result = run_probe("probe_server_args.py", json.dumps(cases))["cases"]
    prefill, decode = result["prefill"], result["decode"]
    assert "error" not in prefill and "error" not in decode, result
    assert prefill["lynx"] is not None and prefill["lynx"]["mode"] == "speculative"
    assert prefill["lynx"] == decode["lynx"]  # the same settings, or they would refuse to pair
    assert "error" in result["typo"], result["typo"]


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
