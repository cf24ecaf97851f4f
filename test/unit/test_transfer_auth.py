"""The authenticated control plane (issue 26 item 5, ``--lynx-auth-key-file``), through the
real ProgressiveSender and ProgressiveReceiver over a fake engine: a keyed pair works end to
end; with a key, unsigned, badly signed and other keys' offers and notices are dropped,
counted and logged once per peer, and the live request does not notice them; a keyed and
an unkeyed server, or two keys, refuse to pair saying so; early offers have a quota per
decode session."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import pytest
import test_transfer_sender_receiver as harness
import torch
from test_transfer_sender_receiver import (
    DECODE_ENDPOINT,
    DECODE_SESSION,
    N_TOKENS,
    PREFILL_ADDR,
    Pair,
    assert_rows_equal,
    reference_rows,
)

from lynx.transfer import AuxStatus, Notice, NoticeKind, Offer, OfferBinding, Stream, Verdict, page_slots
from lynx.transfer import offers as offers_module
from lynx.transfer.auth import AuthKey

KEY = AuthKey(b"the pair's shared key, 32 bytes!")
OTHER = AuthKey(b"another server's key, 32 bytes!!")
WHERE = f"decode {DECODE_ENDPOINT[0]}:{DECODE_ENDPOINT[1]}"
pairs = harness.pairs  # the harness's fixture: closes every pair's sender


def decodes_exactly(pair: Pair, room: int, pages: np.ndarray) -> None:
    """The request's KV, written into rows 0..N_TOKENS, is what the codec reconstructs."""
    assert pair.wait_verdict(room, Verdict.READY) is None
    slots = torch.arange(N_TOKENS)
    pair.receiver.write_kv(room, slots)
    src = page_slots(pages, pair.page_size)[:N_TOKENS]
    want = reference_rows(pair.prefill_rows(src), pair.handshake.codec, residual=True)
    assert_rows_equal(pair.decode_rows(slots), want)


def test_a_keyed_pair_works_end_to_end_and_signs_every_message(pairs: Callable[..., Pair]) -> None:
    pair = pairs(keys=(KEY, KEY))
    offer = pair.offer(1)
    assert offer.verify(KEY, OfferBinding(1, DECODE_SESSION, DECODE_ENDPOINT))
    pages = pair.pages(seed=1)
    pair.send(1, offer, pages, [300, 300])
    decodes_exactly(pair, 1, pages)
    pair.receiver.forget(1)
    pair.wait_released(1)
    assert pair.settling(1) == [NoticeKind.ACCEPT, NoticeKind.LANDED, NoticeKind.LANDED, NoticeKind.RELEASED]
    assert all(len(frames) == 4 for frames in pair.frames)  # each with its MAC
    assert pair.receiver.stats().dropped_notices == {}
    assert pair.sender.stats().dropped_offers == {}
    assert pair.receiver.stats().buffer_used == 0


def test_unsigned_badly_signed_and_other_keys_notices_are_dropped_and_counted(
    pairs: Callable[..., Pair], caplog: pytest.LogCaptureFixture
) -> None:
    """Without a key, each of these would have applied to the live reservation (its nonce
    travels in the clear offer): a LANDED claiming the Anchor, a REJECT or a RELEASED
    failing the request and freeing its space while prefill may still write into it."""
    pair = pairs(keys=(KEY, KEY))
    offer = pair.offer(2)
    nbytes = offer.anchor_nbytes
    forged = [
        Notice(NoticeKind.LANDED, 2, offer.nonce, stream=Stream.ANCHOR, nbytes=nbytes).to_frames(),
        Notice(NoticeKind.REJECT, 2, offer.nonce, text="forged").to_frames(),
        Notice(NoticeKind.RELEASED, 2, offer.nonce).to_frames(OTHER),
        [*Notice(NoticeKind.RELEASED, 2, offer.nonce).to_frames()[:3], bytes(32)],
    ]
    relabelled = Notice(NoticeKind.LANDED, 2, offer.nonce, nbytes=nbytes).to_frames(KEY)
    relabelled[1] = NoticeKind.RELEASED.value  # a signed notice passed off as another kind
    with caplog.at_level(logging.WARNING, logger="lynx.transfer.receiver"):
        for frames in [*forged, relabelled]:
            pair.receiver.on_notice(frames)
    stats = pair.receiver.stats()
    assert stats.dropped_notices == {"unsigned": 2, "bad_signature": 3}
    assert pair.dropped == ["unsigned", "unsigned", "bad_signature", "bad_signature", "bad_signature"]
    assert pair.receiver.verdict(2, AuxStatus.PENDING) == (Verdict.WAIT, None)
    assert stats.buffer_used and stats.quarantined == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [  # once per peer and reason, naming what to check
        f"Lynx: dropping unsigned Lynx notices from prefill {PREFILL_ADDR}: this decode server signs "
        "its Lynx messages (--lynx-auth-key-file) and the sender does not, or they are forged "
        "(logged once per peer; counted as unsigned)",
        f"Lynx: dropping Lynx notices with a bad signature from prefill {PREFILL_ADDR}: the sender "
        "signs with another --lynx-auth-key-file, or they are forged (logged once per peer; counted "
        "as bad_signature)",
    ]
    pages = pair.pages(seed=2)
    pair.send(2, offer, pages, [N_TOKENS])  # the live request goes on, untouched
    decodes_exactly(pair, 2, pages)


def test_forged_offers_take_no_room_and_the_real_one_is_answered(pairs: Callable[..., Pair]) -> None:
    """Old (and without a key): a forged offer that came first for a live room won it, and
    prefill wrote that request's KV to the forger's addresses."""
    pair = pairs(keys=(KEY, KEY))
    offer = pair.reserve(3)
    assert offer is not None
    forger = dataclasses.replace(offer, anchor_addr=offer.anchor_addr + (1 << 20), mac=b"")
    other_room = pair.reserve(4)  # signed for room 4, replayed for room 3
    assert other_room is not None
    binding = OfferBinding(3, "forger:1", DECODE_ENDPOINT)
    for forged in (forger, forger.signed(OTHER, binding), other_room):
        assert pair.sender.take_offer(3, forged.to_wire(), DECODE_ENDPOINT, "forger:1") is None
    assert pair.sender.stats().dropped_offers == {"unsigned": 1, "bad_signature": 2}
    assert pair.sender.stats().offers_waiting == 0  # none took a place among the waiting offers
    assert pair.sender.refusal(3) == (
        f"decode's Lynx offer for room 3 was dropped: {WHERE}'s offer for room 3 (session forger:1) "
        "is not signed with this server's key: forged, replayed with another session or notice "
        "endpoint, or altered on the way"
    )
    assert pair.notices == []  # a forger hears nothing
    assert pair.answer(3, offer.to_wire()) == offer
    pages = pair.pages(seed=3)
    pair.send(3, offer, pages, [N_TOKENS])
    decodes_exactly(pair, 3, pages)
    end = offer.residual_addr + offer.residual_nbytes
    assert all(offer.anchor_addr <= t.dst and t.dst + t.length <= end for t in pair.backend.written())


def test_a_keyed_prefill_refuses_an_unkeyed_decode_saying_so(pairs: Callable[..., Pair]) -> None:
    pair = pairs(keys=(KEY, None))
    offer = pair.reserve(5)
    assert offer is not None and not offer.mac
    assert pair.answer(5, offer.to_wire()) is None  # dropped: nothing to answer when sized
    why = (
        f"this prefill server signs its Lynx messages (--lynx-auth-key-file), {WHERE} does not: "
        "give both servers the same key file, or neither"
    )
    assert pair.sender.refusal(5) == f"decode's Lynx offer for room 5 was dropped: {why}"
    assert pair.sender.stats().dropped_offers == {"unsigned": 1}
    # An unkeyed decode reads the (unsigned) REJECT: its request fails with why, its space is free.
    assert [len(frames) for frames in pair.frames] == [3]
    assert pair.verdict(5) == (Verdict.FAIL, f"prefill {PREFILL_ADDR} refused the Lynx transfer: {why}")
    pair.receiver.forget(5)
    assert (pair.receiver.stats().buffer_used, pair.receiver.stats().quarantined) == (0, 0)


def test_an_unkeyed_prefill_refuses_a_keyed_decode_saying_so(pairs: Callable[..., Pair]) -> None:
    pair = pairs(keys=(None, KEY))
    offer = pair.reserve(6)
    assert offer is not None and offer.mac
    reason = pair.answer(6, offer.to_wire())
    assert reason == (
        f"{WHERE} signs its Lynx messages (--lynx-auth-key-file), this prefill server does not: "
        "give both servers the same key file, or neither"
    )
    assert pair.sender.refusal(6) == reason  # what upstream's failure status tells decode
    # The keyed decode cannot tell the unsigned REJECT from a forger's: dropped, counted.
    assert pair.receiver.stats().dropped_notices == {"unsigned": 1}


def test_two_keys_refuse_to_pair_naming_the_key_ids_only(pairs: Callable[..., Pair]) -> None:
    pair = pairs(keys=(KEY, OTHER))
    offer = pair.reserve(7)
    assert offer is not None
    assert pair.answer(7, offer.to_wire()) is None
    refusal = pair.sender.refusal(7)
    assert refusal == (
        f"decode's Lynx offer for room 7 was dropped: this prefill server and {WHERE} sign their "
        f"Lynx messages with different keys (--lynx-auth-key-file; key ids {KEY.key_id.hex()} and "
        f"{OTHER.key_id.hex()}): give both servers the same key file"
    )
    assert "key, 32 bytes" not in refusal
    assert pair.sender.stats().dropped_offers == {"bad_signature": 1}
    assert pair.notices == []


def test_early_offers_have_a_quota_per_decode_session(pairs: Callable[..., Pair]) -> None:
    """Old: 4096 offers from one decode evicted another decode's offer, whose request then
    failed with the misleading "decode runs without --lynx"."""
    pair = pairs()
    offer = pair.reserve(1)
    assert offer is not None
    assert pair.sender.take_offer(1, offer.to_wire(), DECODE_ENDPOINT, "decode:2") is None
    for room in range(1000, 1000 + 4096):
        pair.sender.take_offer(room, offer.to_wire(), DECODE_ENDPOINT, DECODE_SESSION)
    stats = pair.sender.stats()
    assert stats.dropped_offers == {"quota": 4096 - 1024}
    assert stats.offers_waiting == 1 + 1024
    pair.sender.open_room(1)
    assert pair.sender.size_room(1, N_TOKENS) == offer  # the other decode's offer stayed
    pair.sender.open_room(1000)  # the flooder's oldest went
    assert pair.sender.size_room(1000, N_TOKENS) is None
    assert pair.sender.refusal(1000) == (
        f"decode's Lynx offer for room 1000 was dropped: decode session {DECODE_SESSION} had more "
        "than 1024 offers waiting for rooms with no request; its oldest, for room 1000, is dropped"
    )
    pair.sender.open_room(1000 + 4095)
    assert isinstance(pair.sender.size_room(1000 + 4095, N_TOKENS), Offer | str)


def test_a_captured_offer_replayed_with_another_session_or_notice_endpoint_is_dropped(
    pairs: Callable[..., Pair],
) -> None:
    """Old: the MAC covered the room and the offer, not where the KV and notices go. Re-sent
    first with the attacker's Mooncake session, the captured offer made prefill write the
    prompt's KV to the attacker's engine; with decode's session but another notice endpoint,
    decode never heard ACCEPT and freed the space that prefill's late writes then overwrote."""
    pair = pairs(keys=(KEY, KEY))
    offer = pair.reserve(8)
    assert offer is not None
    captured = offer.to_wire()
    assert pair.sender.take_offer(8, captured, DECODE_ENDPOINT, "attacker:1") is None
    assert pair.sender.take_offer(8, captured, ("10.0.0.66", 9000), DECODE_SESSION) is None
    assert pair.sender.take_offer(8, captured, (DECODE_ENDPOINT[0], 9001), DECODE_SESSION) is None
    assert pair.sender.stats().dropped_offers == {"bad_signature": 3}
    assert pair.sender.stats().offers_waiting == 0  # none took the room
    assert pair.notices == []
    assert pair.answer(8, captured) == offer  # decode's own message, as it was sent, is answered
    pages = pair.pages(seed=8)
    pair.send(8, offer, pages, [N_TOKENS])
    decodes_exactly(pair, 8, pages)


def test_with_a_key_an_offerless_metadata_message_takes_no_room(pairs: Callable[..., Pair]) -> None:
    """Old: an unsigned metadata message without an offer, arriving first, held the room, and
    the real signed offer was then refused ("another offer for room N came first")."""
    pair = pairs(keys=(KEY, KEY))
    offer = pair.reserve(9)
    assert offer is not None
    assert pair.sender.take_offer(9, None, ("10.0.0.66", 9000), "attacker:1") is None
    # nor in upstream's own state: the glue keeps such a message from upstream's thread
    assert not pair.sender.take_metadata(9, None, ("10.0.0.66", 9000), "attacker:1")
    assert not pair.sender.take_metadata(9, offer.to_wire(), ("10.0.0.66", 9000), "attacker:1")
    assert pair.sender.stats().dropped_offers == {"unsigned": 2, "bad_signature": 1}
    assert pair.sender.stats().offers_waiting == 0
    assert pair.answer(9, offer.to_wire()) == offer
    pages = pair.pages(seed=9)
    pair.send(9, offer, pages, [N_TOKENS])
    decodes_exactly(pair, 9, pages)
    # alone, it fails its own request saying why
    pair.sender.take_offer(10, None, DECODE_ENDPOINT, DECODE_SESSION)
    unkeyed = pairs()  # without a key upstream reads it (a decode without Lynx is served)
    assert unkeyed.sender.take_metadata(10, None, DECODE_ENDPOINT, DECODE_SESSION)
    pair.sender.open_room(10)
    assert pair.sender.size_room(10, N_TOKENS) is None
    refusal = pair.sender.refusal(10)
    assert refusal is not None and "this prefill server takes only signed offers" in refusal


def test_with_a_key_an_abort_is_honoured_only_from_the_rooms_decode(pairs: Callable[..., Pair]) -> None:
    """Old: upstream's unauthenticated ABORT for any room stopped its Lynx transfer."""
    pair = pairs(keys=(KEY, KEY))
    offer = pair.offer(11)
    assert not pair.sender.take_abort(11, ("10.0.0.66", 9000))
    assert not pair.sender.take_abort(11, None)
    assert pair.sender.stats().dropped_offers == {"foreign_abort": 2}
    pages = pair.pages(seed=11)
    pair.send(11, offer, pages, [N_TOKENS])
    decodes_exactly(pair, 11, pages)  # the transfer went on
    assert pair.sender.take_abort(12, ("10.0.0.66", 9000))  # no offer here: nothing of ours to stop
    second = pair.offer(13)
    assert pair.sender.take_abort(13, DECODE_ENDPOINT)  # decode's own: the room stops
    assert NoticeKind.RELEASED in pair.kinds(13) and second is not None


def test_without_a_key_an_abort_is_honoured_as_upstream_honours_it(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    pair.offer(14)
    assert pair.sender.take_abort(14, ("10.0.0.66", 9000))
    assert NoticeKind.RELEASED in pair.kinds(14)


def test_waiting_offers_are_bounded_in_bytes(pairs: Callable[..., Pair]) -> None:
    """Old: 4,096 waiting offers with 64 KiB session names held ~269 MB."""
    pair = pairs()
    offer = pair.reserve(1)
    assert offer is not None
    long_session = "s" * 60_000
    for room in range(100, 200):
        pair.sender.take_offer(room, offer.to_wire(), DECODE_ENDPOINT, f"{long_session}{room}")
    stats = pair.sender.stats()
    budget = offers_module._EARLY_OFFER_BYTES
    assert stats.dropped_offers.get("budget", 0) > 0
    assert stats.offers_waiting * 60_000 <= budget
    pair.sender.open_room(199)
    assert pair.sender.size_room(199, N_TOKENS) is None
    refusal = pair.sender.refusal(199)
    assert refusal is not None and f"hold more than {budget} bytes" in refusal
