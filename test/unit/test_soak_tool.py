"""The chaos drill's own logic (``lynx.tools.soak``; the drill itself is
``scripts/soak.sh``, run and reported by hand): what it aims at and how it counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx.tools import soak
from lynx.tools.cluster import ClusterError


def test_prompts_are_distinct_and_the_same_on_every_run() -> None:
    first, again = soak.prompts(6), soak.prompts(6)
    assert first == again and len(set(first)) == 6


def test_the_notice_endpoint_comes_from_decodes_ready_line(tmp_path: Path) -> None:
    # The line lynx_patches.runtime logs when the decode side is built.
    log = tmp_path / "decode.log"
    log.write_text(
        "[2026-11-30 22:29:51] Lynx decode side ready: mode=speculative anchor_bits=4 ...; "
        "receive buffer 10.8 MiB; notices on tcp://127.0.0.1:41733\n"
    )
    assert soak.notice_endpoint(log) == "tcp://127.0.0.1:41733"
    log.write_text("no Lynx here\n")
    with pytest.raises(ClusterError, match="no notice endpoint"):
        soak.notice_endpoint(log)


def test_the_tally_keeps_outcomes_and_error_texts() -> None:
    tally = soak.Tally()
    tally.add("greedy equal")
    tally.add("failed, clear error", "Lynx: the Residual did not land within 6 s" + "x" * 200)
    assert tally.counts == {"greedy equal": 1, "failed, clear error": 1}
    ((text, n),) = tally.errors.items()
    assert n == 1 and len(text) == 120
