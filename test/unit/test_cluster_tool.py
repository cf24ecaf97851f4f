"""``lynx.tools.cluster.PDCluster``'s command lines for several prefill and decode servers
(the servers themselves run in ``test/e2e/test_pd_cluster.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx.tools.cluster import PDCluster, ServerConfig


def test_the_router_gets_every_prefill_with_its_bootstrap_port_and_every_decode(tmp_path: Path) -> None:
    cluster = PDCluster(ServerConfig(model_path=tmp_path), tmp_path, prefills=2, decodes=3)
    argv = cluster._router_argv
    prefills = [argv[i + 1 : i + 3] for i, arg in enumerate(argv) if arg == "--prefill"]
    decodes = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--decode"]
    bootstraps = [str(port) for port in cluster.bootstrap_ports]
    assert prefills == [[url, port] for url, port in zip(cluster.prefill_urls, bootstraps, strict=True)]
    assert decodes == cluster.decode_urls and len(set(decodes)) == 3
    assert (cluster.prefill_url, cluster.decode_url) == (cluster.prefill_urls[0], cluster.decode_urls[0])
    names = [path.name for path in cluster.log_paths]
    assert names == [
        "prefill.log",
        "prefill-1.log",
        "decode.log",
        "decode-1.log",
        "decode-2.log",
        "router.log",
    ]
    for (name, server_argv), bootstrap in zip(cluster._servers, cluster.bootstrap_ports, strict=False):
        assert name.startswith("prefill")
        assert server_argv[server_argv.index("--disaggregation-bootstrap-port") + 1] == str(bootstrap)


def test_a_cluster_needs_both_sides(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"needs a prefill and a decode server, got 1 and 0"):
        PDCluster(ServerConfig(model_path=tmp_path), tmp_path, decodes=0)
