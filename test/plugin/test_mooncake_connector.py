"""Lynx's Mooncake sender and receiver subclasses on real Lynx core objects, with a
stand-in for upstream's manager: how they turn the core's answers into upstream's
request states. Runs in a fresh interpreter (``probe_connector.py``), as the server does."""

from __future__ import annotations

import pytest
from probes import run_probe


@pytest.fixture(scope="module")
def probe() -> dict:
    return run_probe("probe_connector.py")


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
