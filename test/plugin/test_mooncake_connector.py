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
    assert seen["second_step"] == "unregistered"


def test_the_receivers_lynx_steps_are_pinned(probe: dict) -> None:
    """A decode request's connector: it takes the room, offers once receive space is free,
    then decodes in full or starts speculating; every path ends by giving the room up,
    once (the receiver's own room state is pinned in test_transfer_receive). A request
    whose whole prompt decode's radix cache holds takes no room at all."""
    assert probe["receiver_steps"] == {
        "unregistered": ["cached", "waiting_space"],
        "cached": [],
        "waiting_space": ["offered", "released"],
        "offered": ["released", "speculating"],
        "speculating": ["released"],
        "released": [],
    }


def test_the_hooks_know_lynxs_connector_classes_by_type(probe: dict) -> None:
    """The runtime binds to a manager, and decode's commit hook reads a receiver, by the
    role it plays (``runtime.LynxManagerRole``, ``runtime.LynxReceiverRole``), not by
    looking an attribute up by name; upstream's classes play neither."""
    assert probe["roles"] == {
        "LynxKVManager": [True, False],
        "LynxKVReceiver": [False, True],
        "MooncakeKVManager": [False, False],
        "MooncakeKVReceiver": [False, False],
    }


def test_prefill_answers_the_offer_when_the_request_is_sized(probe: dict) -> None:
    same = probe["same_length"]
    assert not same["answered_early"]  # no request for the room yet: the offer waits
    assert same["notices"] == [["ACCEPT", True, ""]]
    assert same["refusal"] is None
    other = probe["other_length"]
    reason = "decode 10.0.0.2:9000 offered space for 24 tokens, this prefill server's request has 28"
    assert other["notices"] == [["REJECT", True, reason]]
    assert other["refusal"] == reason


def test_a_peer_message_upstream_would_die_of_is_refused_first(probe: dict) -> None:
    """Upstream's control threads have no guard: one message they cannot parse (a port that
    is not a number, five bytes of page ids, a frame of garbage) ended prefill's bootstrap
    thread for good, and Lynx's own parse of the metadata raised on it first. What upstream
    reads passes; the rest is refused with a reason."""
    prefill, decode = probe["peer_messages"]["prefill"], probe["peer_messages"]["decode"]
    readable = {"request", "registration", "abort"}
    assert {name for name, why in prefill.items() if why is None} == readable, prefill
    assert "TransferInfo" not in prefill["request, port not a number"]  # named by what failed
    assert "ValueError" in prefill["request, port not a number"]
    assert prefill["watermark while staging is off"] == "WATERMARK while upstream's staging buffers are off"
    assert prefill["watermark, not digits"] == "WATERMARK with fields that are not ASCII"
    assert {name for name, why in decode.items() if why is None} == {"status", "garbage", "aux data"}, decode
    assert decode["aux data, frames cut"] == "AUX_DATA with 2 frames, not 6"
    for room in ("2**64", "-1"):  # upstream reads any digits; no u64 carries them
        assert "room or port is out of range" in prefill[f"request, room {room}"]


def test_the_control_message_hook_outlives_any_one_message(probe: dict) -> None:
    """Old: a room of 2**64 raised out of Lynx's offer handling and ended prefill's bootstrap
    thread (the server then took no request, yet looked healthy); so would any bug of
    Lynx's on one message, on either side. Now the one message is dropped and counted,
    and the thread reads the next; with a key, an ABORT from another decode than the
    room's is not passed on."""
    hook = probe["control_hook"]
    assert hook["prefill"] == {"read": [None, None, None, 4], "survived": 1, "unreadable": 1}
    assert hook["decode"] == {"read": [None, 3], "survived": 1, "unreadable": 0}
