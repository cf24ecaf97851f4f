"""The chaos drill's own logic (``lynx.tools.soak``; the drill itself is
``scripts/soak.sh``, run and reported by hand): what it aims at and how it counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx.tools import soak
from lynx.tools.cluster import ClusterError, lynx_control_endpoint


def test_prompts_are_distinct_and_the_same_on_every_run() -> None:
    first, again = soak.prompts(6), soak.prompts(6)
    assert first == again and len(set(first)) == 6


def test_the_control_endpoint_comes_from_the_ready_line(tmp_path: Path) -> None:
    # The lines lynx_patches.runtime logs when each side is built.
    log = tmp_path / "decode.log"
    log.write_text(
        "[2026-11-30 22:29:51] Lynx decode side ready: mode=speculative anchor_bits=4 ...; "
        "receive buffer 10.8 MiB; notices on tcp://127.0.0.1:41733\n"
    )
    assert lynx_control_endpoint(log) == "tcp://127.0.0.1:41733"
    log.write_text(
        "[...] Lynx prefill side ready: mode=full ...; send buffer 8.0 MiB; offers on tcp://10.0.0.2:5\n"
    )
    assert lynx_control_endpoint(log) == "tcp://10.0.0.2:5"
    log.write_text("no Lynx here\n")
    with pytest.raises(ClusterError, match="no Lynx control endpoint"):
        lynx_control_endpoint(log)


def test_the_tally_keeps_outcomes_and_error_texts() -> None:
    tally = soak.Tally()
    tally.add("greedy equal")
    tally.add("failed, clear error", "Lynx: the Residual did not land within 6 s" + "x" * 200)
    assert tally.counts == {"greedy equal": 1, "failed, clear error": 1}
    ((text, n),) = tally.errors.items()
    assert n == 1 and len(text) == 120


REFERENCE = soak.Reference(
    output_ids=[5, 6, 7],
    top=[{5: -0.1, 9: -3.0}, {6: -1.00, 8: -1.05, 2: -1.5}, {7: -0.2}],
)


def test_a_greedy_answer_equal_to_the_reference_passes() -> None:
    assert soak.judge([5, 6, 7], REFERENCE) == ("greedy equal", None)


def test_a_first_difference_at_a_near_tie_is_counted_apart_with_its_gap() -> None:
    outcome, what = soak.judge([5, 8, 1], REFERENCE)
    assert outcome == "greedy, near-tie"
    assert what is not None and what.startswith("gap 0.0500 at 1:")


def test_a_first_difference_beyond_the_near_tie_gap_or_outside_the_top_is_wrong() -> None:
    assert soak.judge([5, 2, 7], REFERENCE)[0] == "wrong"  # gap 0.5
    assert soak.judge([5, 3, 7], REFERENCE)[0] == "wrong"  # not among the reference's best
    assert soak.judge([5, 6], REFERENCE)[0] == "wrong"  # cut short


def test_the_reference_reads_upstreams_top_logprobs() -> None:
    answer = {"output_ids": [4], "meta_info": {"output_top_logprobs": [[[-0.5, 4, None], [-0.9, 1, None]]]}}
    assert soak.Reference.of(answer) == soak.Reference([4], [{4: -0.5, 1: -0.9}])


def test_with_a_key_file_both_sides_sign() -> None:
    prefill, decode = soak.lynx_args(0.4, Path("/etc/lynx/key"))
    for side in (prefill, decode):
        assert side[side.index("--lynx-auth-key-file") + 1] == "/etc/lynx/key"
    assert all("--lynx-auth-key-file" not in side for side in soak.lynx_args(0.4))
    assert "--lynx-residual-hold" in prefill and "--lynx-residual-hold" not in decode
