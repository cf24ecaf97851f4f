"""Hostile or broken peers against prefill (issue 26), through the real ProgressiveSender
and ProgressiveReceiver over a fake engine: nothing a decode server sends, and no failure
of the lanes, raises out of the sender; only the room concerned fails, with a reason, its
send space comes back, decode hears RELEASED as soon as nothing can be written into its
space, and the server serves the next request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from test_transfer_sender_receiver import (
    DECODE_ENDPOINT,
    DECODE_SESSION,
    LAYOUT,
    N_TOKENS,
    PREFILL_ADDR,
    CopyBackend,
    Pair,
    complete,
    request_nbytes,
    wait_for,
)

from lynx.codec import CodecConfig
from lynx.lanes import BatchState
from lynx.transfer import Handshake, NoticeKind, RoomError, Verdict


@pytest.fixture
def pairs(request: pytest.FixtureRequest) -> Callable[..., Pair]:
    def make(**kwargs: object) -> Pair:
        pair = Pair(**kwargs)  # type: ignore[arg-type]
        request.addfinalizer(pair.sender.close)
        return pair

    return make


def serves_on(pair: Pair, room: int) -> None:
    """A new request goes through, end to end."""
    offer = pair.offer(room)
    pair.send(room, offer, pair.pages(seed=room), [N_TOKENS])
    assert pair.wait_verdict(room, Verdict.READY) is None


# ---- item 1: nothing a peer sends ends a thread or a server ---------------------------------


@pytest.mark.parametrize("space", ["anchor_wraps", "residual_wraps", "overlapping"])
def test_an_offer_for_space_no_write_can_reach_is_refused_before_accept(
    pairs: Callable[..., Pair], space: str
) -> None:
    """Old: the sizes were right, so it was ACCEPTed; its first chunk raised AddressError out
    of add_chunk, the error path's abort raised KeyError "unknown request '7'" on the
    scheduler thread (upstream's catch-all ends the process), and the room's send space was
    never freed."""
    pair = pairs()
    offer = pair.reserve(7)
    assert offer is not None and offer.residual_nbytes
    top = (1 << 64) - 64
    hostile = {
        "anchor_wraps": dataclasses.replace(offer, anchor_addr=top),
        "residual_wraps": dataclasses.replace(offer, residual_addr=top),
        "overlapping": dataclasses.replace(offer, residual_addr=offer.anchor_addr + 64),
    }[space]
    reason = pair.answer(7, hostile.to_wire())
    assert isinstance(reason, str)
    if space == "overlapping":
        assert reason.startswith("decode 10.0.0.2:9000 offered Anchor space 0x")
        assert reason.endswith("that overlap")
    else:
        assert reason.startswith("decode 10.0.0.2:9000 offered receive space no write can reach")
        assert f"0x{top:x}" in reason
    assert [(n.kind, n.nonce) for n in pair.notices] == [(NoticeKind.REJECT, offer.nonce)]
    assert pair.sender.refusal(7) == reason
    with pytest.raises(ValueError, match="no accepted Lynx offer"):
        pair.sender.add_chunk(7, pair.pages(seed=7), True)
    assert pair.backend.written() == []
    assert pair.sender.stats().buffer_used == 0
    serves_on(pair, 8)


class DriverKilled(BaseException):
    """Something no lanes driver pass survives."""


class KillableBackend(CopyBackend):
    """Holds every write (PENDING) until ``kill`` is set; then polling ends the driver."""

    def __init__(self) -> None:
        super().__init__(hold=True)
        self.kill = False

    def poll(self, handle: object) -> BatchState:
        if self.kill:
            raise DriverKilled("gone")
        return super().poll(handle)


def test_a_stopped_lanes_driver_fails_waiting_and_new_rooms_alone(pairs: Callable[..., Pair]) -> None:
    """Old: once the driver had stopped, the LaneError of register_destination escaped
    pump() (LynxKVSender.poll, for a room waiting for send space) and add_chunk (every new
    transfer); the glue's abort then raised KeyError "unknown request", and the room's
    send space was never freed."""
    backend = KillableBackend()
    pair = pairs(backend=backend, send_bytes=2 * request_nbytes(Handshake("full", CodecConfig(), LAYOUT)))
    offers = {room: pair.offer(room) for room in (1, 2, 3)}
    pair.chunk(1, offers[1], pair.pages(seed=1)[:100], False)  # space taken, nothing written
    pair.send(2, offers[2], pair.pages(seed=2), [N_TOKENS])  # writes held in the engine
    wait_for(lambda: bool(backend.written()), "room 2's writes in the engine")
    pair.send(3, offers[3], pair.pages(seed=3), [N_TOKENS])
    assert pair.sender.stats().waiting_for_space == 1 and pair.sender.holds_pages(3)

    backend.kill = True
    wait_for(lambda: not pair.sender.stats().lanes_driver_alive, "the lanes driver to stop")
    pair.wait_released(1)  # nothing of room 1 is in the engine: its space comes back
    pair.sender.pump()  # what LynxKVSender.poll does for room 3: it gets room 1's space
    assert not pair.sender.holds_pages(3)
    offer = pair.offer(4)
    pair.send(4, offer, pair.pages(seed=4), [N_TOKENS])  # a new transfer
    pair.sender.abort(4)  # the glue's error path: nothing left to abort, nothing raised
    stopped = "lanes driver stopped (DriverKilled: gone)"
    failures = dict(pair.failures)
    assert set(failures) == {1, 2, 3, 4}
    for room in (3, 4):
        assert failures[room] == f"cannot send the KV of room {room}: {stopped}: no transfer can move"
        assert pair.kinds(room) == [NoticeKind.ACCEPT, NoticeKind.RELEASED]  # decode may reuse its space
        assert (
            pair.wait_verdict(room, Verdict.FAIL)
            == f"prefill {PREFILL_ADDR} gave the request up before it landed"
        )
    stats = pair.sender.stats()
    assert (stats.rooms, stats.waiting_for_space) == (1, 0)  # room 2: its writes may still land
    assert stats.buffer_used == request_nbytes(pair.handshake)


# ---- item 4: an abort releases decode's space at once when nothing was written -------------


def test_a_room_aborted_before_its_first_chunk_releases_decode_at_once(pairs: Callable[..., Pair]) -> None:
    """Old: a request aborted before prefill's first chunk left no state on prefill, so no
    RELEASED came and decode's space stayed quarantined for twice the deadline."""
    pair = pairs()
    offer = pair.offer(9)  # accepted, never started
    pair.receiver.forget(9)  # decode aborted it: its space waits for RELEASED
    assert pair.receiver.stats().quarantined == 1
    pair.sender.abort(9, "decode aborted the request")
    assert pair.kinds(9) == [NoticeKind.ACCEPT, NoticeKind.RELEASED]
    assert pair.notices[-1].nonce == offer.nonce
    stats = pair.receiver.stats()
    assert (stats.quarantined, stats.buffer_used) == (0, 0)
    pair.sender.add_chunk(9, pair.pages(seed=9), True)  # a late chunk writes nothing
    pair.sender.abort(9)  # and a second abort says nothing more
    assert pair.kinds(9) == [NoticeKind.ACCEPT, NoticeKind.RELEASED]
    assert pair.backend.written() == [] and pair.sender.stats().buffer_used == 0

    # an offer still held (the request's length not known yet) is released too, never accepted
    held = pair.reserve(10)
    assert held is not None
    assert pair.sender.take_offer(10, held.to_wire(), DECODE_ENDPOINT, DECODE_SESSION) is None
    pair.sender.open_room(10)
    pair.receiver.forget(10)
    pair.sender.abort(10, "decode aborted the request")
    assert pair.kinds(10) == [NoticeKind.RELEASED]
    assert pair.sender.size_room(10, N_TOKENS) is None
    assert pair.kinds(10) == [NoticeKind.RELEASED]
    assert pair.sender.refusal(10) == "aborted (decode aborted the request) before its offer was answered"
    assert pair.receiver.stats().quarantined == 0

    # a room whose transfer completed was released once, by the reaper
    complete(pair, 11, seed=11)
    pair.sender.abort(11)
    assert pair.kinds(11).count(NoticeKind.RELEASED) == 1
    serves_on(pair, 12)


# ---- item 6: a room reused while its previous transfer drains ------------------------------


def test_a_room_reused_while_its_previous_transfer_drains_is_refused(pairs: Callable[..., Pair]) -> None:
    """Old: the new offer was ACCEPTed and the new request's chunks were dropped silently
    (the room's state was the old, closed transfer's); decode failed at the deadline,
    blaming a stalled prefill."""
    backend = CopyBackend(hold=True)
    pair = pairs(backend=backend)
    old = pair.offer(13)
    pair.send(13, old, pair.pages(seed=13), [N_TOKENS])
    wait_for(lambda: bool(backend.written()), "a write in the engine")
    pair.sender.close_room(13)  # upstream is done with the request; its writes drain
    pair.receiver.forget(13)
    new = pair.reserve(13)
    assert new is not None
    reason = pair.answer(13, new.to_wire())
    assert reason == (
        "room 13 (bootstrap_room) still sends the KV of this prefill server's previous request "
        "of the room: a room cannot be reused until its transfer drains"
    )
    assert [(n.kind, n.nonce) for n in pair.notices if n.room == 13][-1] == (NoticeKind.REJECT, new.nonce)
    assert (
        pair.wait_verdict(13, Verdict.FAIL) == f"prefill {PREFILL_ADDR} refused the Lynx transfer: {reason}"
    )
    backend.hold.clear()
    pair.wait_released(13)
    wait_for(lambda: pair.sender.stats().rooms == 0, "the old transfer to drain")
    pair.receiver.forget(13)
    pair.sender.close_room(13)
    serves_on(pair, 13)


def test_an_offer_replayed_after_its_reservation_ended_is_refused(pairs: Callable[..., Pair]) -> None:
    """Old: the old offer (room and nonce) was accepted again and prefill wrote into space
    decode had given to another request."""
    pair = pairs()
    offer, _ = complete(pair, 14, seed=14)
    pair.sender.close_room(14)
    reason = pair.answer(14, offer.to_wire())
    assert reason == (
        f"decode 10.0.0.2:9000 offered reservation {offer.nonce:#x} of room 14 again, after it ended"
    )
    written = len(pair.backend.written())
    with pytest.raises(ValueError, match="no accepted Lynx offer"):
        pair.sender.add_chunk(14, pair.pages(seed=14), True)
    assert len(pair.backend.written()) == written


# ---- issue 46: no room number ends a thread; every thread that reads peer input survives --


@pytest.mark.parametrize("room", [1 << 64, -1, (1 << 64) + 5])
def test_a_room_outside_u64_is_refused_by_every_entry_that_takes_one(
    pairs: Callable[..., Pair], room: int
) -> None:
    """Old: a room of 2**64 (upstream parses any digits) was held, then packed as a u64 and
    ``struct.error`` escaped: from the bootstrap thread (two offers for it: the duplicate's
    REJECT), the reaper (one that expired), or the scheduler (a client's ``bootstrap_room``
    at decode's reserve or prefill's sizing)."""
    pair = pairs()
    offer = pair.reserve(1)
    assert offer is not None
    held = pair.receiver.stats().buffer_used
    for take in (
        lambda: pair.sender.take_offer(room, offer.to_wire(), DECODE_ENDPOINT, DECODE_SESSION),
        lambda: pair.sender.open_room(room),
        lambda: pair.sender.size_room(room, N_TOKENS),
        lambda: pair.receiver.register(room, N_TOKENS, peer=PREFILL_ADDR),
    ):
        with pytest.raises(RoomError, match=r"is not an integer in 0\.\.2\*\*64-1"):
            take()
    assert pair.sender.stats().offers_waiting == 0 and pair.receiver.stats().buffer_used == held
    serves_on(pair, 2)


def test_the_reaper_survives_an_exception_from_one_room_and_goes_on(
    pairs: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Old: any exception in the reaper's loop ended it; no RELEASED was sent after that and
    no send space was freed again."""
    pair = pairs(offer_wait_s=0.05)
    offer = pair.reserve(3)
    assert offer is not None
    real_release = pair.sender._release
    broken = {3}

    def release(room: int) -> None:
        if room in broken:
            raise RuntimeError(f"a bug releasing room {room}")
        real_release(room)

    monkeypatch.setattr(pair.sender, "_release", release)
    real_drop = pair.sender._offers.drop_offer

    def drop(room: int, held: object, reason: str) -> None:
        if room == 5:
            raise RuntimeError("a bug dropping an expired offer")
        real_drop(room, held, reason)  # type: ignore[arg-type]

    monkeypatch.setattr(pair.sender._offers, "drop_offer", drop)
    early = pair.reserve(5)
    assert early is not None
    pair.sender.take_offer(5, early.to_wire(), DECODE_ENDPOINT, DECODE_SESSION)  # expires at once
    with caplog.at_level("ERROR", logger="lynx.transfer.sender"):
        pair.answer(3, offer.to_wire())
        pair.send(3, offer, pair.pages(seed=3), [N_TOKENS])
        assert pair.wait_verdict(3, Verdict.READY) is None
        wait_for(lambda: pair.sender._reaper_survivor.count >= 2, "the reaper to meet both bugs")
        serves_on(pair, 4)  # later rooms are still released, by the same thread
        pair.receiver.forget(4)
        pair.wait_released(4)
    assert pair.sender._reaper.is_alive()
    logged = [r.getMessage() for r in caplog.records if "sender reaper" in r.getMessage()]
    assert len(logged) == 2, logged  # each kind once, not once a pass
    assert "releasing room 3 raised RuntimeError: a bug releasing room 3" in logged[0] + logged[1]
