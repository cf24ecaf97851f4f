"""Lynx's subclasses of SGLang's Mooncake KV manager, sender and receiver.

Swapped in by :mod:`lynx_patches.disaggregation_utils` (``get_kv_class``) when ``--lynx``
is on; never imported otherwise. They hold no Lynx logic of their own: the manager gets
this process's :class:`~lynx_patches.runtime.LynxRuntime` (``lynx_attach``) and routes
upstream's calls to its sender or receiver; every upstream internal they touch goes
through :mod:`lynx_patches.upstream`. They keep everything upstream does for a request --
bootstrap, ZMQ control messages, the aux data with the first output token, status,
heartbeats, aborts -- and replace only the raw KV page copy: prefill hands each chunk's
pages to :class:`lynx.transfer.ProgressiveSender` and gives upstream's transfer worker an
empty page list (so it still sends aux data and ``Success``); decode gates upstream's
``Success`` on :class:`lynx.transfer.ProgressiveReceiver` and decodes the landed bytes
into the request's KV pages before the scheduler sees ``Success``.

Upstream methods overridden (all in ``sglang.srt.disaggregation``; their signatures are
in ``upstream.CONTRACT``). Threads: ``_make_worker_recv``'s function runs on upstream's
bootstrap/status thread; every other method on the scheduler thread.

* ``mooncake.conn.MooncakeKVManager``: ``__init__``, ``send_aux`` (prefill: the first
  token on the control channel, ahead of the Anchor's writes), ``_make_worker_recv`` (take Lynx
  offers off decode's metadata messages on prefill, Lynx notices on decode; drop a peer's
  message upstream's thread would die of, see ``upstream.unreadable_peer_message``; stop
  an aborted room's lanes on prefill, and with a key drop an ABORT from another decode
  than the room's; survive any exception of Lynx's own on one message),
  ``add_transfer_request`` (prefill: encode and send instead of the page copy; a request
  decode's radix cache holds whole sends no KV, upstream's aux data only),
  ``build_receiver_metadata_message`` (decode: append the offer, signed over the
  message's room, session and notice endpoint),
  ``_handle_node_failure`` (decode: upstream's heartbeat declared a prefill dead, so the
  receive space it may have written is free), ``teardown``.
* ``mooncake.conn.MooncakeKVSender``: ``__init__`` and ``init`` (the request of the room
  exists, then its length is known: only then is decode's offer answered), ``poll`` (encode
  what the sender holds: the last chunk's Residuals, once upstream has the first token to
  send; hold ``Success`` until every chunk is encoded: their KV pages must stay), ``clear``.
* ``mooncake.conn.MooncakeKVReceiver``: ``send_metadata`` (refuse a prefill server of
  another attention-TP size; take the room, reserve receive space first; wait if there is
  none; none of this where decode's radix cache holds the whole prompt), ``poll`` (the
  Lynx gate, then decode), ``abort``, ``clear``, ``failure_exception`` (a request refused
  for a room another request holds fails alone, with Lynx's reason).

What upstream pieces Lynx could not reuse: the transfer worker's page copy (it writes
raw pages into decode's KV pool, which a Lynx request must not see before it is decoded,
and has no priority), and upstream's staging buffers (``SGLANG_DISAGG_STAGING_BUFFER``:
they exist for TP-mismatched raw copies, are slot-per-chunk and not registered per
request). Upstream's status messages have fixed positional fields, so Lynx's notices are
messages of their own on the same sockets.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver, MooncakeKVSender

from lynx import settings
from lynx.threads import Survivor
from lynx.transfer import (
    DuplicateRoomError,
    OfferBinding,
    ReceiveCapacityError,
    RoomError,
    RoomReport,
    Verdict,
    page_slots,
)
from lynx.transfer.protocol import split_offer
from lynx_patches import upstream
from lynx_patches.errors import LynxConfigError
from lynx_patches.runtime import LynxManagerRole, LynxReceiverRole, LynxRuntime

logger = logging.getLogger(__name__)


class LynxKVManager(MooncakeKVManager, LynxManagerRole):
    # Failure reasons travel with prefill's status messages (upstream's decode parses the
    # optional frame), so a decode server without Lynx shows why Lynx refused the request.
    kv_status_msg_carries_reason = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        lynx_settings = settings.current()
        if lynx_settings is None:
            raise LynxConfigError("LynxKVManager used without --lynx")
        self.lynx_settings = lynx_settings
        self.lynx: LynxRuntime | None = None  # set by lynx_attach, right after construction
        self.lynx_unreadable_messages = 0  # peer messages dropped before upstream's thread read them
        self.lynx_survivor = Survivor(logger, "control-message hook")
        super().__init__(*args, **kwargs)

    def lynx_attach(self, runtime: LynxRuntime) -> None:
        self.lynx = runtime

    def teardown(self) -> None:
        if self.lynx is not None:
            self.lynx.close()
        super().teardown()

    def send_aux(self, req: Any, prefill_aux_index: int, dst_aux_ptrs: list[int]) -> Any:
        """(Prefill, upstream's transfer worker) The aux data (the first token and its
        logprobs) goes on the control channel (upstream's ``AUX_DATA`` message, which
        every decode reads), not as a transfer-engine write queued behind the Anchor's:
        decode streams the first token as soon as it lands (``disaggregation_decode``)."""
        return self.send_aux_tcp(req, prefill_aux_index, dst_aux_ptrs)

    # ---- messages (bootstrap/status thread) -------------------------------------------------

    def _make_worker_recv(self, socket: Any, timeout_ms: int = 500) -> Any:
        recv = super()._make_worker_recv(socket, timeout_ms)

        def lynx_recv() -> list[bytes] | None:
            msg = recv()
            if msg is None:
                return None
            try:
                return self._lynx_read(msg)
            except Exception as exc:  # upstream's thread must outlive any one message
                self.lynx_survivor.survived("reading a control message", exc)
                return None

        return lynx_recv

    def _lynx_read(self, msg: list[bytes]) -> list[bytes] | None:
        """(Bootstrap/status thread) What upstream's thread reads of a peer's message
        ``msg``: None for a Lynx notice (taken here), for one upstream would die of and,
        with a key, for an ABORT from another decode than the room's; else its upstream
        frames (a Lynx offer taken off them first)."""
        receiver = self.lynx.receiver if self.lynx is not None else None
        if receiver is not None and receiver.on_message(msg):
            return None
        frames, offer = split_offer(msg)
        unreadable = upstream.unreadable_peer_message(self, frames)
        if unreadable is not None:
            self._lynx_drop_unreadable(unreadable)
            return None
        if upstream.manager_is_prefill(self):
            aborted = upstream.aborted_room(frames)
            sender = self.lynx.sender if self.lynx is not None else None
            if aborted is not None and sender is not None and not sender.take_abort(*aborted):
                return None
            if not self._lynx_take_offer(frames, offer):
                return None
        return frames

    def _lynx_drop_unreadable(self, why: str) -> None:
        """A peer's message upstream's thread would have died of: dropped, counted, and
        logged the first time and then every 1,000th, so a flood cannot flood the log."""
        self.lynx_unreadable_messages += 1
        if self.lynx_unreadable_messages % 1000 == 1:
            logger.warning(
                "Lynx: dropped %d unreadable control message(s) on %s, the last %s",
                self.lynx_unreadable_messages,
                upstream.control_endpoint(self),
                why,
            )

    def _lynx_take_offer(self, frames: list[bytes], offer: bytes | None) -> bool:
        """Prefill: decode's per-request metadata arrived (with Lynx's offer, or without);
        whether upstream's thread may read it (with a key: not one whose offer is not
        authentic, which would take the room in upstream's own state)."""
        meta = upstream.parse_metadata_frames(frames)
        if meta is None or meta.is_dummy:
            return True  # not a request's metadata, or a dummy rank: nothing is sent to it
        sender = self.lynx.sender if self.lynx is not None else None
        if sender is None:
            logger.error(
                "Lynx: room %s arrived before this prefill server's Lynx sender was ready", meta.room
            )
            return True
        return sender.take_metadata(meta.room, offer, meta.endpoint, meta.session)

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        super()._handle_node_failure(failed_bootstrap_addr)
        receiver = self.lynx.receiver if self.lynx is not None else None
        if receiver is not None:  # a dead prefill writes nothing more: its space is free
            receiver.peer_lost(failed_bootstrap_addr)

    # ---- prefill: the chunk copy becomes encode + lanes ----------------------------------

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: Any,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        room = bootstrap_room
        sender = self.lynx.sender if self.lynx is not None else None
        if upstream.room_is_live(self, room) and not (sender is not None and sender.sends_no_kv(room)):
            reason = (
                "this prefill server's Lynx sender is not ready" if sender is None else sender.refusal(room)
            )
            if reason is None and state_indices:
                reason = "this model carries extra state (mamba/SWA) Lynx does not send"
            if reason is not None:
                logger.error("Lynx: room %s: %s", room, reason)
                upstream.fail_room(self, room, f"Lynx: {reason}")
                return
            assert sender is not None
            upstream.synchronize_send_events(kwargs)
            pages = kv_indices.numpy() if isinstance(kv_indices, torch.Tensor) else np.asarray(kv_indices)
            try:
                sender.add_chunk(room, pages, is_last_chunk)
            except Exception as exc:  # a Lynx bug fails this request, not the server
                logger.exception("Lynx: room %s: sending its KV failed", room)
                sender.abort(room, "internal error")
                upstream.fail_room(self, room, f"Lynx internal error: {exc}")
                return
            kv_indices = pages[:0]  # upstream's worker still sends the aux data and Success
        super().add_transfer_request(
            bootstrap_room,
            kv_indices,
            index_slice,
            is_last_chunk,
            aux_index=aux_index,
            state_indices=state_indices,
            num_kv_tokens=num_kv_tokens,
            **kwargs,
        )

    # ---- decode: the offer rides on upstream's metadata message ----------------------------

    def build_receiver_metadata_message(
        self, *, bootstrap_room: int, is_dummy: bool, **kwargs: Any
    ) -> list[bytes]:
        frames = super().build_receiver_metadata_message(
            bootstrap_room=bootstrap_room, is_dummy=is_dummy, **kwargs
        )
        receiver = self.lynx.receiver if self.lynx is not None else None
        if is_dummy or receiver is None:
            return frames
        meta = upstream.parse_metadata_frames(frames)
        if meta is None:  # a room out of range: register refused it, so it has no offer
            return frames
        # The offer is signed over where prefill will write and answer, as these frames say.
        return receiver.append_offer(frames, OfferBinding(meta.room, meta.session, meta.endpoint))


class LynxKVSender(MooncakeKVSender):
    kv_mgr: LynxKVManager

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lynx = self.kv_mgr.lynx
        if lynx is not None and lynx.sender is not None:
            try:
                lynx.sender.open_room(self.bootstrap_room)
            except RoomError as exc:  # a client's bootstrap_room: this request fails, alone
                self._lynx_refuse(exc)

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        lynx = self.kv_mgr.lynx
        if lynx is not None and lynx.sender is not None:  # decode's slots: whole pages, as here
            try:
                lynx.sender.size_room(self.bootstrap_room, num_kv_indices * lynx.page_size)
            except RoomError as exc:
                self._lynx_refuse(exc)

    def _lynx_refuse(self, exc: RoomError) -> None:
        logger.error("Lynx: %s", exc)
        upstream.fail_room(self.kv_mgr, self.bootstrap_room, f"Lynx: {exc}")

    def poll(self) -> int:
        status = super().poll()
        lynx = self.kv_mgr.lynx
        sender = lynx.sender if lynx is not None else None
        if status in (KVPoll.Transferring, KVPoll.Success) and sender is not None:
            # The last chunk's Residuals are encoded here, once upstream has the first token
            # to send (add_transfer_request), or chunks still wait for send space.
            if sender.holds_pages(self.bootstrap_room):
                sender.pump()
            if status == KVPoll.Success and sender.holds_pages(self.bootstrap_room):
                return KVPoll.Transferring  # its KV pages must stay until they are encoded
        return status

    def clear(self) -> None:
        room = self.bootstrap_room
        lynx = self.kv_mgr.lynx
        if lynx is not None and lynx.sender is not None:
            if upstream.room_failed(self.kv_mgr, room):
                lynx.sender.abort(room, "the request failed on the prefill server")
            lynx.sender.close_room(room)
        super().clear()


class ReceiverStep(enum.Enum):
    """Where one decode request's connector stands with Lynx. What has landed for the
    room is the core's (:class:`lynx.transfer.ReceiveTracker`); once the request decodes
    on its Anchor, its speculation is the decoder's
    (:class:`lynx.speculative.Speculation`)."""

    UNREGISTERED = "unregistered"  # before send_metadata, or failed before taking the room
    # decode's radix cache (--disaggregation-decode-enable-radix-cache) holds the whole
    # prompt: prefill sends no KV, only upstream's aux data, and Lynx takes no room
    CACHED = "cached"
    WAITING_SPACE = "waiting_space"  # took the room; the metadata waits for receive space
    OFFERED = "offered"  # metadata and offer out; upstream's Success waits on Lynx's verdict
    SPECULATING = "speculating"  # its Anchor is in the KV, the room kept for the decoder
    RELEASED = "released"  # the room given up: decoded in full, failed, aborted or cleared


RECEIVER_STEPS: dict[ReceiverStep, frozenset[ReceiverStep]] = {
    ReceiverStep.UNREGISTERED: frozenset({ReceiverStep.WAITING_SPACE, ReceiverStep.CACHED}),
    ReceiverStep.CACHED: frozenset(),
    ReceiverStep.WAITING_SPACE: frozenset({ReceiverStep.OFFERED, ReceiverStep.RELEASED}),
    ReceiverStep.OFFERED: frozenset({ReceiverStep.SPECULATING, ReceiverStep.RELEASED}),
    ReceiverStep.SPECULATING: frozenset({ReceiverStep.RELEASED}),
    ReceiverStep.RELEASED: frozenset(),
}


class LynxKVReceiver(MooncakeKVReceiver, LynxReceiverRole):
    kv_mgr: LynxKVManager
    lynx_step = ReceiverStep.UNREGISTERED
    lynx_slots: torch.Tensor | None = None  # the request's KV slots, in token order
    lynx_report: RoomReport | None = None  # what its transfer cost, once released after decoding
    lynx_aux_landed = False  # upstream's aux data (the first token) landed while Lynx's KV travels
    lynx_first_token_committed = False  # the first token is in the request ahead of its KV
    # WAITING_SPACE: upstream's send_metadata call, made once receive space is reserved
    _lynx_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    _lynx_refused: str | None = None  # why this request failed alone (its room is another's)

    def _lynx_move(self, step: ReceiverStep) -> None:
        if step not in RECEIVER_STEPS[self.lynx_step]:
            room = self.bootstrap_room
            raise RuntimeError(f"room {room}: Lynx receiver {self.lynx_step.value} -> {step.value}")
        self.lynx_step = step

    @property
    def lynx_speculating(self) -> bool:
        """Speculative mode: its Anchor is in the KV, the Residual may be in flight; the
        room outlives this receiver (the SpeculativeDecoder takes it over at commit)."""
        return self.lynx_step is ReceiverStep.SPECULATING

    @property
    def _lynx(self) -> LynxRuntime:
        lynx = self.kv_mgr.lynx
        assert lynx is not None and lynx.receiver is not None, "Lynx's receiver is not built"
        return lynx

    def send_metadata(self, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        state_indices = upstream.metadata_state_indices(args, kwargs)
        if state_indices and any(len(s) for s in state_indices if s is not None):
            self._lynx_fail("this model carries extra state (mamba/SWA) Lynx does not receive")
            return
        peer_ranks = upstream.peer_attn_tp_size(self)
        if peer_ranks is not None and peer_ranks != self._lynx.tp_ranks:
            # Each prefill rank encodes and sends its own heads to the decode rank of the same
            # index; a mixed layout would need head ranges split and merged across ranks.
            self._lynx_fail(
                f"prefill {self.bootstrap_addr} splits the KV heads over {peer_ranks} TP rank(s), "
                f"this decode server over {self._lynx.tp_ranks}: Lynx pairs prefill and decode "
                "ranks one to one and needs the same --tp-size (attention TP) on both; run them "
                "with equal sizes, or without --lynx"
            )
            # Armed, so prefill's drain ACK releases the pages at once (upstream holds a
            # failed request's pages until the ACK, or for its release timeout).
            self.ensure_abort_notified(force_arm=True)
            return
        if len(kv_indices) == 0:  # prefill sends from decode_prefix_len on: here, nothing
            self._lynx_move(ReceiverStep.CACHED)
            super().send_metadata(kv_indices, *args, **kwargs)
            return
        self.lynx_slots = page_slots(np.asarray(kv_indices), self._lynx.page_size)
        receiver = self._lynx.receiver
        assert receiver is not None
        try:
            receiver.register(self.bootstrap_room, self.lynx_slots.numel(), peer=self.bootstrap_addr)
        except DuplicateRoomError as exc:  # the room's state is the other request's: touch none of it
            logger.error("Lynx: %s", exc)
            self._lynx_refused = f"Lynx: {exc}"
            upstream.fail_receiver_alone(self)
            return
        except (ReceiveCapacityError, RoomError) as exc:
            self._lynx_fail(str(exc))
            return
        self._lynx_move(ReceiverStep.WAITING_SPACE)
        self._lynx_call = ((kv_indices, *args), kwargs)
        self._lynx_publish()

    def _lynx_publish(self) -> bool:
        """Reserve receive space and send the metadata; False while there is none."""
        receiver = self._lynx.receiver
        assert receiver is not None and self._lynx_call is not None
        if receiver.reserve(self.bootstrap_room) is None:
            return False
        args, kwargs = self._lynx_call
        self._lynx_call = None
        self._lynx_move(ReceiverStep.OFFERED)
        super().send_metadata(*args, **kwargs)  # build_receiver_metadata_message appends the offer
        return True

    def _lynx_fail(self, reason: str) -> None:
        upstream.fail_receiver(self, f"Lynx: {reason}")

    def poll(self) -> int:
        if self.lynx_step is ReceiverStep.WAITING_SPACE and not self._lynx_publish():
            status = super().poll()
            return status if status == KVPoll.Failed else KVPoll.WaitingForInput
        status = super().poll()
        if self.lynx_step is not ReceiverStep.OFFERED:
            return status
        lynx = self._lynx
        receiver = lynx.receiver
        assert receiver is not None
        room = self.bootstrap_room
        verdict, reason = receiver.verdict(room, upstream.upstream_status(status))
        if verdict is Verdict.WAIT:
            if status == KVPoll.Success:
                self.lynx_aux_landed = True  # decode's hook may stream the first token now
                return KVPoll.Transferring
            return status
        if verdict is Verdict.FAIL:
            if status != KVPoll.Failed:
                logger.error("Lynx: room %s failed: %s", room, reason)
                self._lynx_fail(reason or "transfer failed")
                self.ensure_abort_notified()
            if lynx.metrics is not None:
                lynx.metrics.failed()
            self._lynx_release()
            return KVPoll.Failed
        assert self.lynx_slots is not None
        try:
            full = receiver.write_kv(room, self.lynx_slots)
        except Exception as exc:  # a Lynx bug (or corrupt bytes) fails this request, not the server
            logger.exception("Lynx: room %s: writing its KV failed", room)
            self._lynx_fail(f"decoding the received KV failed: {exc}")
            self.ensure_abort_notified()
            self._lynx_release()
            return KVPoll.Failed
        # With TP ranks, one rank's Residual may have landed and another's not: every rank
        # admits the request to speculation alike and they agree when to verify (a request
        # refined everywhere commits at once, with nothing held).
        if receiver.mode.verifies and (not full or lynx.tp_ranks > 1):
            self._lynx_move(ReceiverStep.SPECULATING)
            return status
        self.lynx_report = self._lynx_release()
        if self.lynx_report is not None and lynx.metrics is not None:
            lynx.metrics.observe(self.lynx_report)
        return status

    def abort(self) -> None:
        self._lynx_release()
        super().abort()

    def failure_exception(self) -> None:
        if self._lynx_refused is not None:
            raise upstream.receiver_failure(self, self._lynx_refused)
        super().failure_exception()

    def clear(self) -> None:
        if not self.lynx_speculating:
            self._lynx_release()
        super().clear()

    def lynx_end_speculation(self) -> None:
        """The request ended at commit: nobody will verify it."""
        self._lynx_release()

    def _lynx_release(self) -> RoomReport | None:
        """Give the room's Lynx state up, once: a later request may take the room."""
        if self.lynx_step in (ReceiverStep.UNREGISTERED, ReceiverStep.CACHED, ReceiverStep.RELEASED):
            return None
        self._lynx_move(ReceiverStep.RELEASED)
        self._lynx_call = None
        lynx = self.kv_mgr.lynx
        if lynx is None or lynx.receiver is None:
            return None
        return lynx.receiver.forget(self.bootstrap_room)


LYNX_CLASSES: dict[type, type] = {
    MooncakeKVManager: LynxKVManager,
    MooncakeKVSender: LynxKVSender,
    MooncakeKVReceiver: LynxKVReceiver,
}
