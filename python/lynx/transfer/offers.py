"""Prefill side: decode's offers, held until this server's request for their room is
sized, then answered ACCEPT or REJECT (pairing).

Decode's metadata for a room may arrive before prefill's request for it exists (upstream
creates the request's KV sender when the scheduler takes it in, and sizes it after
bootstrap), so an offer waits until the request exists and its token count is known
(:meth:`OfferDesk.open_room`, :meth:`OfferDesk.size_room`). Offers for rooms with no
request wait a bounded time and in bounded number, per decode session and in all; then
they are dropped and counted (``SenderStats.dropped_offers``). With a key an offer is
taken only if it carries the key's MAC over its fields, its room and where it sends; any
other is dropped before it can take a room or a place among the waiting offers, counted
(``unsigned``, ``bad_signature``, ``malformed``), logged once per decode session, and the
room's request, if it comes, fails saying so.

Threads: the bootstrap thread (offers, ABORTs), the scheduler (requests opened, sized,
closed; the first chunk takes the accepted offer), the reaper (expired offers). State is
guarded by the sender's lock (:class:`~lynx.transfer.send_rooms.SendRooms`); notices are
sent outside it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from lynx.lanes import AddressError, AddressRanges
from lynx.transfer.auth import NO_KEY, AuthKey, LogOncePerPeer
from lynx.transfer.protocol import (
    Handshake,
    Notice,
    NoticeKind,
    Offer,
    OfferBinding,
    ProtocolError,
    RequestLayout,
    Stream,
    check_room,
    key_mismatch,
    parse_handshake,
)
from lynx.transfer.send_rooms import Endpoint, Notices, SendRooms

log = logging.getLogger(__name__)

NO_OFFER = (
    "sent no Lynx offer: it runs without --lynx (start both servers with --lynx and the same --lynx-* flags)"
)
_EARLY_OFFERS_KEPT = 4096  # offers for rooms this server has no request for (yet)
# ... of which one decode session may hold this many, so that no one decode evicts
# another's: it takes four sessions to reach the overall bound. With a key the session is
# covered by the offer's MAC, so this is a quota per authenticated peer; without one any
# peer may claim any session name, and only the bounds in all hold.
_EARLY_OFFERS_PER_SESSION = _EARLY_OFFERS_KEPT // 4
# What the waiting offers may hold in all, in bytes (an offer, its session and host names
# and _HELD_OFFER_OVERHEAD each): a legal offer is ~130 bytes, a hostile one up to
# ~64 KiB of names; past the budget a new one is refused.
_HELD_OFFER_OVERHEAD = 256
_EARLY_OFFER_BYTES = _EARLY_OFFERS_KEPT * 1024
# What decode hears when prefill drops its offer unanswered, by reason.
_DROPPED_OFFER = {
    "duplicate": "another offer for room {room} (bootstrap_room) came first",
    "overflow": (
        f"more than {_EARLY_OFFERS_KEPT} offers waited for rooms with no request; the oldest, "
        "for room {room}, is dropped"
    ),
    "quota": (
        f"decode session {{session}} had more than {_EARLY_OFFERS_PER_SESSION} offers waiting for "
        "rooms with no request; its oldest, for room {room}, is dropped"
    ),
    "expired": "no request for room {room} came while its offer waited",
    "budget": (
        f"the offers waiting for rooms with no request hold more than {_EARLY_OFFER_BYTES} bytes; "
        "the offer for room {room} is refused"
    ),
}


@dataclass
class HeldOffer:
    """Decode's metadata for a room, not answered yet."""

    offer_bytes: bytes | None  # None: decode runs without Lynx
    endpoint: Endpoint
    session: str
    arrived: float

    @property
    def nbytes(self) -> int:
        """What holding it costs, about: its bytes, its names and a fixed overhead."""
        offer = 0 if self.offer_bytes is None else len(self.offer_bytes)
        return offer + len(self.session) + len(self.endpoint[0]) + _HELD_OFFER_OVERHEAD


class EarlyOffers:
    """Offers for rooms with no request (yet), oldest first, at most
    ``_EARLY_OFFERS_PER_SESSION`` per decode session, ``_EARLY_OFFERS_KEPT`` and
    ``_EARLY_OFFER_BYTES`` in all."""

    def __init__(self) -> None:
        self._offers: OrderedDict[int, HeldOffer] = OrderedDict()
        self._by_session: dict[str, OrderedDict[int, None]] = {}
        self.nbytes = 0

    def __contains__(self, room: int) -> bool:
        return room in self._offers

    def __len__(self) -> int:
        return len(self._offers)

    def add(self, room: int, held: HeldOffer) -> tuple[int, HeldOffer, str] | None:
        """Hold ``held`` (``room`` holds no offer); returns the offer dropped to make room
        for it, with the reason, if any: ``held`` itself past the byte budget."""
        if self.nbytes + held.nbytes > _EARLY_OFFER_BYTES:
            return room, held, "budget"
        self._offers[room] = held
        self.nbytes += held.nbytes
        rooms = self._by_session.setdefault(held.session, OrderedDict())
        rooms[room] = None
        if len(rooms) > _EARLY_OFFERS_PER_SESSION:
            oldest = next(iter(rooms))
            return oldest, self._pop(oldest), "quota"
        if len(self._offers) > _EARLY_OFFERS_KEPT:
            oldest = next(iter(self._offers))
            return oldest, self._pop(oldest), "overflow"
        return None

    def get(self, room: int) -> HeldOffer | None:
        return self._offers.get(room)

    def pop(self, room: int) -> HeldOffer | None:
        return self._pop(room) if room in self._offers else None

    def expire(self, now: float, wait_s: float) -> list[tuple[int, HeldOffer, str]]:
        """Take the offers that waited ``wait_s`` for a request."""
        expired = []
        while self._offers:
            room, held = next(iter(self._offers.items()))
            if now - held.arrived < wait_s:
                break
            expired.append((room, self._pop(room), "expired"))
        return expired

    def _pop(self, room: int) -> HeldOffer:
        held = self._offers.pop(room)
        self.nbytes -= held.nbytes
        rooms = self._by_session[held.session]
        del rooms[room]
        if not rooms:
            del self._by_session[held.session]
        return held


Accepted = tuple[str, Endpoint, Offer]  # decode's session, its notice endpoint, the offer


class OfferDesk:
    """Decode's offers and this server's answers to them, per room. ``notices`` sends
    to decode (lock not held); ``handshake`` is this side's, signed; ``offer_wait_s``: how
    long an offer for a room with no request waits for it."""

    def __init__(
        self,
        rooms: SendRooms,
        *,
        handshake: Handshake,
        auth: AuthKey | None,
        notices: Notices,
        offer_wait_s: float,
    ) -> None:
        self._rooms = rooms
        self._lock = rooms.lock
        self._handshake = handshake
        self._auth = auth
        self._notices = notices
        self._offer_wait_s = offer_wait_s
        self._log_once = LogOncePerPeer(log)
        # room -> its request's token count, None until known: this server's requests
        self._requests: dict[int, int | None] = {}
        self._offers: dict[int, HeldOffer] = {}  # for a request whose length is not known yet
        self._early_offers = EarlyOffers()  # for no request (yet)
        self.dropped: dict[str, int] = {}  # reason -> offers (and ABORTs) dropped unanswered
        # room -> why its last offer was dropped unanswered, for its request's failure
        self._dropped_why: OrderedDict[int, str] = OrderedDict()
        # room -> (decode's session, its control endpoint, the accepted offer) or the refusal
        self._answers: dict[int, Accepted | str] = {}

    def take_offer(
        self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str
    ) -> Offer | str | None:
        """Decode's metadata for ``room`` arrived (bootstrap thread) from its Mooncake
        ``session``, with control ``endpoint``, and with its Lynx offer or without
        (``offer_bytes`` None: decode runs without Lynx). Answered (ACCEPT or REJECT, and
        remembered for :meth:`add_chunk`) once this server's request for the room has its
        length (:meth:`size_room`); returns the answer if that is now, else None. With a
        key, a message without a valid MAC over its offer, ``room``, ``session`` and
        ``endpoint`` (a missing offer included) takes no room and no place among the
        waiting offers. RoomError for a room no Lynx message can name."""
        held = self._admit(room, offer_bytes, endpoint, session)
        return None if held is None else self._take(room, held)

    def take_metadata(self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str) -> bool:
        """:meth:`take_offer` for the metadata message upstream's thread reads next:
        whether it may read it. With a key, not one that is dropped unauthenticated:
        upstream would take the room in its own state for it, and answer that sender."""
        held = self._admit(room, offer_bytes, endpoint, session)
        if held is not None:
            self._take(room, held)
        return held is not None

    def _admit(
        self, room: int, offer_bytes: bytes | None, endpoint: Endpoint, session: str
    ) -> HeldOffer | None:
        """The message as an offer to hold; None if, with a key, it is not authentic."""
        check_room(room)
        held = HeldOffer(offer_bytes, endpoint, session, time.monotonic())
        if self._auth is not None and not self._authentic(room, held):
            return None  # it takes no room and no place among the waiting offers
        return held

    def _take(self, room: int, held: HeldOffer) -> Offer | str | None:
        """Hold or answer an admitted offer (see :meth:`take_offer`)."""
        dropped: list[tuple[int, HeldOffer, str]] = []
        try:
            with self._lock:
                dropped += self._early_offers.expire(held.arrived, self._offer_wait_s)
                if room in self._answers or room in self._offers or room in self._early_offers:
                    dropped.append((room, held, "duplicate"))
                    return None
                if room not in self._requests:
                    evicted = self._early_offers.add(room, held)
                    if evicted is not None:
                        dropped.append(evicted)
                    return None
                n_tokens = self._requests[room]
                if n_tokens is None:
                    self._offers[room] = held
                    return None
        finally:
            for dropped_room, dropped_offer, reason in dropped:
                self.drop_offer(dropped_room, dropped_offer, reason)
        return self._answer(room, held, n_tokens)

    def _authentic(self, room: int, held: HeldOffer) -> bool:
        """Whether ``held`` carries this server's key's MAC over its offer, ``room`` and
        where it sends (its session and notice endpoint, as received). If not, it is
        dropped: counted, logged once per decode session, and its room's request fails
        saying why. Only fixed-size fields are read before the MAC is checked."""
        assert self._auth is not None
        where = f"decode {held.endpoint[0]}:{held.endpoint[1]}"
        mine = self._auth.key_id
        answer_unsigned: Notice | None = None
        if held.offer_bytes is None:  # an unsigned claim on the room: it must not take it
            reason, why = "unsigned", f"{where} {NO_OFFER}, and this prefill server takes only signed offers"
        else:
            reason, why, answer_unsigned = self._unauthentic_offer(room, held, where, mine)
            if not reason:
                return True
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
            self._remember_dropped(room, why)
        self._log_once(
            reason, held.session, f"dropping Lynx offers of {where} (session {held.session}): {why}"
        )
        if answer_unsigned is not None:
            self._notices.send_unsigned(held.endpoint, answer_unsigned)
        return False

    def _unauthentic_offer(
        self, room: int, held: HeldOffer, where: str, mine: bytes
    ) -> tuple[str, str, Notice | None]:
        """(reason counted, why, an unsigned REJECT to send or None) for an offer that
        does not carry this server's MAC over it and its binding; ("", "", None) for one
        that does."""
        assert self._auth is not None and held.offer_bytes is not None
        answer_unsigned: Notice | None = None
        try:
            offer = Offer.from_wire(held.offer_bytes)
            theirs = Handshake.key_id_of(offer.handshake)
        except ProtocolError as exc:
            reason, why = "malformed", f"cannot read the decode server's Lynx offer: {exc}"
        else:
            if offer.verify(self._auth, OfferBinding(room, held.session, held.endpoint)):
                return "", "", None
            reason = "bad_signature" if offer.mac else "unsigned"
            if theirs != mine and (theirs == NO_KEY) == (reason == "unsigned"):  # a peer's settings
                why = key_mismatch(mine, theirs, this="this prefill server", other=where)
            else:
                what = "unsigned" if reason == "unsigned" else "not signed with this server's key"
                why = (
                    f"{where}'s offer for room {room} (session {held.session}) is {what}: forged, "
                    "replayed with another session or notice endpoint, or altered on the way"
                )
            if theirs == NO_KEY and reason == "unsigned":
                # A decode without a key applies an unsigned REJECT (its space is free at
                # once); one with a key drops it. This server writes into no space an
                # unsigned offer names, so the REJECT frees nothing a write of ours reaches.
                answer_unsigned = Notice(NoticeKind.REJECT, room, offer.nonce, text=why)
        return reason, why, answer_unsigned

    def _remember_dropped(self, room: int, why: str) -> None:
        """(Lock held) why ``room``'s offer was dropped, for :meth:`refusal`."""
        self._dropped_why[room] = why
        self._dropped_why.move_to_end(room)
        if len(self._dropped_why) > _EARLY_OFFERS_KEPT:
            self._dropped_why.popitem(last=False)

    def open_room(self, room: int) -> None:
        """This server has a request for ``room`` (scheduler thread): its offer waits for
        :meth:`size_room`, however long that takes. RoomError for a room no Lynx message
        can name (a client's ``bootstrap_room``): the caller fails that request."""
        check_room(room)
        with self._lock:
            self._requests.setdefault(room, None)
            held = self._early_offers.pop(room)
            if held is not None:
                self._offers[room] = held

    def size_room(self, room: int, n_tokens: int) -> Offer | str | None:
        """The request of ``room`` sends ``n_tokens`` tokens (scheduler thread): answer its
        offer if it came. Returns the answer, or None if no offer came yet. ``n_tokens`` is 0
        where decode's radix cache holds the whole prompt: nothing is sent (:meth:`sends_no_kv`),
        and an offer for it is refused. RoomError as :meth:`open_room`."""
        check_room(room)
        with self._lock:
            self._requests[room] = n_tokens
            held = self._offers.pop(room, None) or self._early_offers.pop(room)
        return None if held is None else self._answer(room, held, n_tokens)

    def _answer(self, room: int, held: HeldOffer, n_tokens: int) -> Offer | str:
        """Check the offer against this side, tell decode ACCEPT or REJECT, remember it."""
        where = f"decode {held.endpoint[0]}:{held.endpoint[1]}"
        notice = None
        if held.offer_bytes is None:
            answer: Offer | str = f"{where} {NO_OFFER}"  # it would not understand a notice
        else:
            try:
                offer = Offer.from_wire(held.offer_bytes)
            except ProtocolError as exc:  # no nonce to answer with: upstream's failure tells decode
                answer = f"cannot read the decode server's Lynx offer: {exc}"
            else:
                reason = self._offer_mismatch(offer, where, n_tokens) or self._room_unavailable(
                    room, offer, where
                )
                if reason is None:
                    answer = offer
                    notice = Notice(NoticeKind.ACCEPT, room, offer.nonce, handshake=self._handshake.to_wire())
                else:
                    answer = reason
                    notice = Notice(NoticeKind.REJECT, room, offer.nonce, text=reason)
        if isinstance(answer, str) and held.offer_bytes is not None:  # no offer: the glue says why
            log.error("Lynx: refusing room %s: %s", room, answer)
        with self._lock:
            self._answers[room] = answer if isinstance(answer, str) else (held.session, held.endpoint, answer)
        if notice is not None:
            self._notices.send(held.endpoint, notice)
        return answer

    def _offer_mismatch(self, offer: Offer, where: str, n_tokens: int) -> str | None:
        """Why ``offer`` cannot carry this server's request of ``n_tokens`` tokens, or None.
        Sizes are compared by arithmetic: nothing is built from the peer's numbers."""
        try:
            theirs = parse_handshake(offer.handshake)
        except ProtocolError as exc:
            return f"cannot read the decode server's Lynx offer: {exc}"
        mismatch = self._handshake.mismatch(theirs, this="this prefill server", other=where)
        if mismatch is not None:
            return mismatch
        if n_tokens == 0:
            return (
                f"{where} offered space for {offer.n_tokens} tokens, this prefill server's request "
                "sends none (decode's radix cache holds its whole prompt): no offer is due"
            )
        if offer.n_tokens != n_tokens:
            return (
                f"{where} offered space for {offer.n_tokens} tokens, this prefill server's "
                f"request has {n_tokens}"
            )
        sent = RequestLayout.sent_nbytes_of(self._handshake, n_tokens)
        if (offer.anchor_nbytes, offer.residual_nbytes) != (sent[Stream.ANCHOR], sent[Stream.RESIDUAL]):
            return (
                f"{where} offered {offer.anchor_nbytes}+{offer.residual_nbytes} bytes for "
                f"{n_tokens} tokens, this side sends {sent[Stream.ANCHOR]}+{sent[Stream.RESIDUAL]}"
            )
        # The lanes check every write against these spans; spans they cannot even hold
        # would fail the room only at its first chunk, after decode was told ACCEPT.
        try:
            AddressRanges.union(offer.spans())
        except AddressError as exc:
            return f"{where} offered receive space no write can reach ({exc})"
        if offer.residual_nbytes and (
            offer.anchor_addr < offer.residual_addr + offer.residual_nbytes
            and offer.residual_addr < offer.anchor_addr + offer.anchor_nbytes
        ):
            return (
                f"{where} offered Anchor space 0x{offer.anchor_addr:x}+{offer.anchor_nbytes} and "
                f"Residual space 0x{offer.residual_addr:x}+{offer.residual_nbytes} that overlap"
            )
        return None

    def _room_unavailable(self, room: int, offer: Offer, where: str) -> str | None:
        """Why this server cannot take ``offer`` for ``room`` now, or None."""
        with self._lock:
            if room in self._rooms.rooms:
                # Its state is the previous transfer's (lanes, send space, RELEASED to come):
                # a second transfer of the room would find it and could not be told apart.
                return (
                    f"room {room} (bootstrap_room) still sends the KV of this prefill server's "
                    "previous request of the room: a room cannot be reused until its transfer drains"
                )
            if self._rooms.ended(room, offer.nonce):  # its space may serve another request by now
                return f"{where} offered reservation {offer.nonce:#x} of room {room} again, after it ended"
        return None

    def drop_offer(self, room: int, held: HeldOffer, reason: str) -> None:
        """Refuse (lock not held) an offer this server will not answer otherwise: decode's
        request fails saying why, and its receive space, which no write of ours can reach,
        is free at once (decode frees a reservation's space only on word from prefill)."""
        log.warning("Lynx: dropping decode's offer for room %s (%s)", room, reason)
        text = _DROPPED_OFFER[reason].format(room=room, session=held.session)
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
            self._remember_dropped(room, text)
            live = self._answers.get(room)
            waiting = self._offers.get(room) or self._early_offers.get(room)
        if held.offer_bytes is None:
            return  # decode runs without Lynx: it reads no notice
        try:
            offer = Offer.from_wire(held.offer_bytes)
        except ProtocolError:
            return  # no nonce to answer with
        nonces = {
            Offer.from_wire(waiting.offer_bytes).nonce if waiting and waiting.offer_bytes else None,
            live[2].nonce if isinstance(live, tuple) else None,
        }
        if offer.nonce in nonces:
            return  # the offer being answered, sent again: refusing it would fail its request
        self._notices.send(held.endpoint, Notice(NoticeKind.REJECT, room, offer.nonce, text=text))

    def sends_no_kv(self, room: int) -> bool:
        """Whether the request of ``room`` was sized at 0 tokens: decode's radix cache
        (``decode_prefix_len``) holds its whole prompt, upstream sends only its aux data."""
        with self._lock:
            return self._requests.get(room) == 0

    def refusal(self, room: int) -> str | None:
        """Why ``room`` cannot be sent with Lynx (no offer came, it was dropped, or it was
        refused); None once its offer was accepted."""
        with self._lock:
            answer = self._answers.get(room)
            dropped = self._dropped_why.get(room)
        if answer is None:
            if dropped is not None:
                return f"decode's Lynx offer for room {room} was dropped: {dropped}"
            return f"the decode server {NO_OFFER}"
        return answer if isinstance(answer, str) else None

    def close_room(self, room: int) -> None:
        """The request is done on this side: forget it and its offer."""
        with self._lock:
            self._requests.pop(room, None)
            self._offers.pop(room, None)
            self._early_offers.pop(room)
            self._answers.pop(room, None)
            self._dropped_why.pop(room, None)

    # ---- scheduler thread -------------------------------------------------------------------

    def accepted(self, room: int) -> Accepted:
        """(Lock held) The room's accepted offer, with decode's session and notice
        endpoint; ValueError if it has none."""
        answer = self._answers.get(room)
        if answer is None or isinstance(answer, str):
            raise ValueError(f"room {room} has no accepted Lynx offer")
        return answer

    def owner(self, room: int) -> Endpoint | None:
        """The control endpoint of the decode whose offer for ``room`` this server holds,
        answered or waiting; None if there is none."""
        with self._lock:
            state = self._rooms.rooms.get(room)
            if state is not None:
                return state.endpoint
            answer = self._answers.get(room)
            if isinstance(answer, tuple):
                return answer[1]
            held = self._offers.get(room) or self._early_offers.get(room)
            return None if held is None else held.endpoint

    def honours_abort(self, room: int, peer: Endpoint | None) -> bool:
        """Whether decode's ABORT for ``room``, naming ``peer`` as its control endpoint
        (None: it names none), may stop the room. Upstream's ABORT is unsigned: without a
        key it is honoured as upstream honours it; with one, only from the endpoint the
        room's signed offer named, or for a room no offer names here (no Lynx transfer to
        stop; upstream's drain ACK still frees decode's pages). One refused is counted
        (``foreign_abort``) and logged once per endpoint."""
        if self._auth is None:
            return True
        owner = self.owner(room)
        if owner is None or peer == owner:
            return True
        named = "no endpoint" if peer is None else f"{peer[0]}:{peer[1]}"
        with self._lock:
            self.dropped["foreign_abort"] = self.dropped.get("foreign_abort", 0) + 1
        self._log_once(
            "foreign_abort",
            named,
            f"ignoring an ABORT for room {room} naming {named}: the room's signed offer came "
            f"from decode {owner[0]}:{owner[1]}",
        )
        return False

    def give_up_unanswered(self, room: int, reason: str) -> tuple[Endpoint, int] | None:
        """(Lock held) ``room``, whose transfer did not start, is aborted: forget its offer,
        and return where to send RELEASED with which nonce (None: no reservation of it is
        open here)."""
        answer = self._answers.get(room)
        if isinstance(answer, tuple):  # accepted, no chunk yet
            _, endpoint, offer = answer
            if self._rooms.ended(room, offer.nonce):  # aborted or released already
                return None
            self._rooms.end(room, offer.nonce)
            return endpoint, offer.nonce
        held = self._offers.pop(room, None) or self._early_offers.pop(room)
        if held is None or held.offer_bytes is None:
            return None
        if room in self._requests:  # its request must not read "no offer came"
            self._answers[room] = f"aborted ({reason}) before its offer was answered"
        try:
            offer = Offer.from_wire(held.offer_bytes)
        except ProtocolError:
            return None  # no nonce to answer with
        self._rooms.end(room, offer.nonce)
        return held.endpoint, offer.nonce

    def expired(self) -> list[tuple[int, HeldOffer, str]]:
        """Take the offers for rooms with no request that waited their time (reaper
        thread); :meth:`drop_offer` refuses each."""
        with self._lock:
            return self._early_offers.expire(time.monotonic(), self._offer_wait_s)

    def waiting(self) -> int:
        """(Lock held) Offers waiting for a request, or for its length."""
        return len(self._offers) + len(self._early_offers)
