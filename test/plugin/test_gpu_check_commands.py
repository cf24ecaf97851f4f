"""The server command lines of the GPU check's pd step (``lynx.tools.gpu_check.pd_step``),
parsed by upstream's own parser with the Lynx plugin loaded (no GPU needed to parse them),
so a flag typo fails here and not on the CUDA host the check was prepared for."""

from __future__ import annotations

import json
from pathlib import Path

from probes import run_probe

from lynx.tools.gpu_check import parse_args, resolve_transfer, server_commands


def test_every_pd_server_command_parses_with_upstream_and_the_plugin(
    tiny_model: Path, tmp_path: Path
) -> None:
    options = parse_args([])
    (tmp_path / "mlx5_0").mkdir()  # a host with an RDMA device, as far as the choice goes
    cases = {}
    for transport in ("tcp", "rdma"):
        transfer = resolve_transfer(transport, None, tmp_path)
        for config, sides in server_commands(options, transfer, tiny_model).items():
            for side, argv in sides.items():
                assert argv[1:3] == ["-m", "sglang.launch_server"], argv
                args = [{"<port>": "30000", "<bootstrap-port>": "8998"}.get(a, a) for a in argv[3:]]
                cases[f"{transport}-{config}-{side}"] = args
    result = run_probe("probe_server_args.py", json.dumps(cases))["cases"]
    for name, parsed in result.items():
        assert "error" not in parsed, (name, parsed)
        transport, config, side = name.split("-")
        if config == "plain":
            assert parsed["lynx"] is None, name
            continue
        lynx = parsed["lynx"]
        assert (lynx["mode"], lynx["residual"]) == (config, "exact"), name
        assert lynx["residual_hold_s"] == (0.5 if config == "speculative" else 0.0), name
        # both sides of a configuration run with the same settings, or they would refuse to pair
        assert lynx == result[f"{transport}-{config}-prefill"]["lynx"], name
