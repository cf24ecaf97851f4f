"""Lynx's Mooncake sender and receiver subclasses on real Lynx core objects, with a
stand-in for upstream's manager: how they turn the core's answers into upstream's
request states. Runs in a fresh interpreter (``probe_connector.py``), as the server does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CPU_ENV = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}


@pytest.fixture(scope="module")
def probe() -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "probe_connector.py")],
        capture_output=True,
        text=True,
        env=CPU_ENV,
        timeout=600,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("PROBE-RESULT "))


def test_a_duplicate_room_on_decode_fails_only_the_second_request(probe: dict) -> None:
    """Old: the second request's reservation raised out of send_metadata, in the scheduler."""
    seen = probe["duplicate_room"]
    assert seen["polled_failed"]
    assert seen["reason"].startswith("Lynx: room 4242 (bootstrap_room) is already taken by another request")
    # the first request's state, on Lynx's side and upstream's, is untouched
    assert seen["first_kept"] and seen["first_offer_kept"]
    assert seen["room_status_kept"]
    assert seen["failure_records"] == {}
    assert not seen["abort_sent"]  # an abort for the room would fail the first request on prefill


def test_prefill_answers_the_offer_when_the_request_is_sized(probe: dict) -> None:
    same = probe["same_length"]
    assert not same["answered_early"]  # no request for the room yet: the offer waits
    assert same["notices"] == [["ACCEPT", True, ""]]
    assert same["refusal"] is None
    other = probe["other_length"]
    reason = "decode 10.0.0.2:9000 offered space for 24 tokens, this prefill server's request has 28"
    assert other["notices"] == [["REJECT", True, reason]]
    assert other["refusal"] == reason
