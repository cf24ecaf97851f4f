"""Lynx's subclasses of SGLang's Mooncake KV manager, sender and receiver.

Swapped in by :mod:`lynx_patches.disaggregation_utils` (``get_kv_class``) when ``--lynx``
is on; never imported otherwise. They keep everything upstream does for a request --
bootstrap, ZMQ control messages, the aux data with the first output token, status,
heartbeats, aborts -- and replace only the raw KV page copy: prefill hands each chunk's
pages to :class:`lynx.transfer.ProgressiveSender` and gives upstream's transfer worker an
empty page list (so it still sends aux data and ``Success``); decode gates upstream's
``Success`` on :class:`lynx.transfer.ProgressiveReceiver` and decodes the landed bytes
into the request's KV pages before the scheduler sees ``Success``.

Upstream methods overridden (all in ``sglang.srt.disaggregation``):

* ``mooncake.conn.MooncakeKVManager``: ``__init__``, ``_make_worker_recv`` (take Lynx
  offers off decode's metadata messages on prefill, Lynx notices on decode),
  ``add_transfer_request`` (prefill: encode and send instead of the page copy),
  ``build_receiver_metadata_message`` (decode: append the offer),
  ``_handle_abort_notification`` (prefill: stop the request's lanes), ``teardown``.
* ``mooncake.conn.MooncakeKVSender``: ``poll`` (hold ``Success`` while chunks wait for
  send space: their KV pages must stay), ``clear``.
* ``mooncake.conn.MooncakeKVReceiver``: ``send_metadata`` (reserve receive space first;
  wait if there is none), ``poll`` (the Lynx gate, then decode), ``abort``, ``clear``.

What upstream pieces Lynx could not reuse: the transfer worker's page copy (it writes
raw pages into decode's KV pool, which a Lynx request must not see before it is decoded,
and has no priority), and upstream's staging buffers (``SGLANG_DISAGG_STAGING_BUFFER``:
they exist for TP-mismatched raw copies, are slot-per-chunk and not registered per
request). Upstream's status messages have fixed positional fields, so Lynx's notices are
messages of their own on the same sockets.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver, MooncakeKVSender
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from lynx import settings
from lynx.codec import CodecError, cpp_backend, kv_layout_of
from lynx.lanes import LaneConfig
from lynx.lanes.mooncake import MooncakeBackend
from lynx.transfer import (
    Handshake,
    Offer,
    ProgressiveReceiver,
    ProgressiveSender,
    ReceiveCapacityError,
    RoomReport,
    Upstream,
    Verdict,
    page_slots,
)
from lynx.transfer.metrics import TransferMetrics
from lynx.transfer.protocol import append_offer, bytes_per_token, is_notice, split_offer
from lynx_patches.lynx_speculation import SpeculativeDecoder

logger = logging.getLogger(__name__)

_UPSTREAM_OF_POLL = {KVPoll.Success: Upstream.SUCCESS, KVPoll.Failed: Upstream.FAILED}


class LynxConfigError(RuntimeError):
    """This server's KV pool or parallelism cannot run Lynx (raised at start-up)."""


def _buffer_bytes(pool_rows: int, handshake: Handshake, requested: int) -> int:
    if requested:
        return requested
    anchor, residual = bytes_per_token(handshake.layout, handshake.codec)
    # Every KV row of the pool may be in flight at once; 1 MiB for per-request alignment.
    return math.ceil(pool_rows * (anchor + residual)) + (1 << 20)


class LynxKVManager(MooncakeKVManager):
    # Failure reasons travel with prefill's status messages (upstream's decode parses the
    # optional frame), so a decode server without Lynx shows why Lynx refused the request.
    kv_status_msg_carries_reason = True

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
        **kwargs: Any,
    ) -> None:
        lynx_settings = settings.current()
        if lynx_settings is None:
            raise LynxConfigError("LynxKVManager used without --lynx")
        if is_mla_backend:
            raise LynxConfigError("--lynx supports MHA/GQA KV pools, not MLA models")
        self.lynx_settings = lynx_settings
        self.lynx_sender: ProgressiveSender | None = None
        self.lynx_receiver: ProgressiveReceiver | None = None
        self.lynx_speculation: SpeculativeDecoder | None = None
        self.lynx_metrics: TransferMetrics | None = None
        # prefill: room -> (decode session, decode endpoint, offer) or the refusal reason
        self._lynx_offers: dict[int, tuple[str, tuple[str, int], Offer] | str] = {}
        # decode: room -> offer to append to the metadata message a receiver is building
        self.lynx_outgoing: dict[int, Offer] = {}
        self.lynx_page_size = 1  # the KV pool's, set by lynx_attach_pool
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)

    # ---- set-up (scheduler thread, right after construction) -------------------------------

    def lynx_attach_pool(self, pool: Any) -> None:
        """Bind Lynx to the server's KV pool; refuse pools it cannot encode."""
        k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
        if not isinstance(k, list) or not isinstance(v, list):
            raise LynxConfigError(f"--lynx needs an MHA KV pool with per-layer K/V buffers, got {type(pool)}")
        if getattr(pool, "store_dtype", pool.dtype) != pool.dtype:
            raise LynxConfigError(f"--lynx does not support a quantized KV cache ({pool.dtype})")
        try:
            layout = kv_layout_of(k, v)
            handshake = Handshake(self.lynx_settings.mode, self.lynx_settings.codec_config(), layout)
            bytes_per_token(layout, handshake.codec)  # checks group_size against head_dim
        except CodecError as exc:
            raise LynxConfigError(f"--lynx cannot encode this KV pool: {exc}") from exc
        if k[0].device.type == "cpu":
            cpp_backend.available()  # build or load the C++ codec now, not on the first request
        rows = k[0].shape[0]
        nbytes = _buffer_bytes(rows, handshake, self.lynx_settings.buffer_bytes)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=k[0].device)
        page_size = int(self.kv_args.page_size)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            backend = MooncakeBackend.attach(self.engine.engine, self.engine.get_session_id())
            self.lynx_sender = ProgressiveSender(
                backend=backend,
                buffer=buffer,
                k_buffers=k,
                v_buffers=v,
                page_size=page_size,
                handshake=handshake,
                lane_config=LaneConfig(
                    low_chunk_bytes=self.lynx_settings.lane_chunk_bytes,
                    deadline_s=self.lynx_settings.transfer_deadline_s,
                ),
                notify=self._lynx_notify,
                on_failure=self._lynx_fail_room,
                hold_s=(self.lynx_settings.anchor_hold_s, self.lynx_settings.residual_hold_s),
            )
        else:
            if getattr(self.server_args, "enable_metrics", False):
                self.lynx_metrics = TransferMetrics({"engine_rank": str(self.kv_args.engine_rank)})
            self.engine.register(buffer.data_ptr(), nbytes)
            self.lynx_receiver = ProgressiveReceiver(
                buffer=buffer,
                k_buffers=k,
                v_buffers=v,
                handshake=handshake,
                deadline_s=self.lynx_settings.transfer_deadline_s,
            )
            if self.lynx_settings.mode == "speculative":
                self.lynx_speculation = SpeculativeDecoder(
                    self.lynx_receiver,
                    self.lynx_settings.max_speculative_tokens,
                    page_size,
                    self.lynx_metrics,
                )
        self.lynx_page_size = page_size
        logger.info(
            "Lynx %s side ready: %s; %s buffer %.1f MiB",
            self.disaggregation_mode.value,
            handshake.describe(),
            "send" if self.lynx_sender else "receive",
            nbytes / (1 << 20),
        )

    def lynx_stats(self) -> dict[str, Any]:
        side = self.lynx_sender or self.lynx_receiver
        stats = {} if side is None else vars(side.stats())
        if self.lynx_speculation is not None:
            spec = self.lynx_speculation.stats
            stats["speculation"] = {
                **vars(spec),
                "acceptance_rate": spec.acceptance_rate,
                "agreement_rate": spec.agreement_rate,
            }
        return stats

    def teardown(self) -> None:
        if self.lynx_sender is not None:
            self.lynx_sender.close()
        super().teardown()

    # ---- messages ------------------------------------------------------------------------------

    def _make_worker_recv(self, socket: Any, timeout_ms: int = 500) -> Any:
        recv = super()._make_worker_recv(socket, timeout_ms)

        def lynx_recv() -> list[bytes] | None:
            msg = recv()
            if msg is None:
                return None
            if is_notice(msg):
                if self.lynx_receiver is not None:
                    self.lynx_receiver.on_notice(msg)
                return None
            frames, offer = split_offer(msg)
            if self.disaggregation_mode == DisaggregationMode.PREFILL and frames[0].isdigit():
                self._lynx_take_offer(frames, offer)
            return frames

        return lynx_recv

    def _lynx_take_offer(self, frames: list[bytes], offer: bytes | None) -> None:
        """Prefill bootstrap thread: decode's per-request metadata arrived."""
        if frames[4] == b"" and frames[5] == b"":
            return  # a dummy rank: nothing is sent to it
        room = int(frames[0])
        endpoint = (frames[1].decode("ascii"), int(frames[2]))
        session = frames[3].decode("ascii")
        if self.lynx_sender is None:
            self._lynx_offers[room] = "this prefill server's Lynx sender is not ready"
            return
        answer = self.lynx_sender.answer_offer(room, offer, endpoint)
        self._lynx_offers[room] = answer if isinstance(answer, str) else (session, endpoint, answer)

    def _lynx_notify(self, endpoint: tuple[str, int], frames: list[bytes]) -> None:
        address = NetworkAddress(*endpoint)
        try:
            self._send_multipart_locked(address.to_tcp(), frames, is_ipv6=address.is_ipv6)
        except Exception as exc:  # a dead decode: its requests fail on its side
            logger.warning("Lynx: notice to %s not sent: %s", address.to_host_port_str(), exc)

    def _lynx_fail_room(self, room: int, reason: str) -> None:
        self.conclude_failure(bootstrap_room=room, failure_reason=f"Lynx: {reason}")

    def _handle_abort_notification(self, msg: list[bytes]) -> bool:
        if msg and msg[0] == ABORT_TAG and self.lynx_sender is not None:
            notification = AbortNotification.from_zmq(msg)
            if notification is not None:
                self.lynx_sender.abort(notification.room, "decode aborted the request")
        return super()._handle_abort_notification(msg)

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
        active = (
            room in self.request_status
            and self.check_status(room) != KVPoll.Failed
            and any(not info.is_dummy for info in self.transfer_infos.get(room, {}).values())
        )
        if active:
            answer = self._lynx_offers.get(room)
            if answer is None or isinstance(answer, str):
                reason = answer or (
                    "the decode server sent no Lynx offer: it runs without --lynx "
                    "(start both servers with --lynx and the same --lynx-* flags)"
                )
                logger.error("Lynx: room %s: %s", room, reason)
                self.conclude_failure(bootstrap_room=room, failure_reason=f"Lynx: {reason}")
                return
            if state_indices:
                self.conclude_failure(
                    bootstrap_room=room,
                    failure_reason="Lynx: this model carries extra state (mamba/SWA) Lynx does not send",
                )
                return
            for event in (kwargs.pop("wait_event", None), kwargs.pop("indices_event", None)):
                if event is not None:
                    event.synchronize()
            pages = kv_indices.numpy() if isinstance(kv_indices, torch.Tensor) else np.asarray(kv_indices)
            session, endpoint, offer = answer
            assert self.lynx_sender is not None
            try:
                self.lynx_sender.add_chunk(room, session, endpoint, offer, pages, is_last_chunk)
            except Exception as exc:  # a Lynx bug fails this request, not the server
                logger.exception("Lynx: room %s: sending its KV failed", room)
                self.lynx_sender.abort(room, "internal error")
                self.conclude_failure(bootstrap_room=room, failure_reason=f"Lynx internal error: {exc}")
                return
            kv_indices = pages[:0]
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

    def lynx_forget_room(self, room: int) -> None:
        self._lynx_offers.pop(room, None)

    # ---- decode: the offer rides on upstream's metadata message ----------------------------

    def build_receiver_metadata_message(
        self, *, bootstrap_room: int, is_dummy: bool, **kwargs: Any
    ) -> list[bytes]:
        frames = super().build_receiver_metadata_message(
            bootstrap_room=bootstrap_room, is_dummy=is_dummy, **kwargs
        )
        offer = self.lynx_outgoing.get(bootstrap_room)
        return frames if is_dummy or offer is None else append_offer(frames, offer)


class LynxKVSender(MooncakeKVSender):
    kv_mgr: LynxKVManager

    def poll(self) -> int:
        status = super().poll()
        sender = self.kv_mgr.lynx_sender
        if status == KVPoll.Success and sender is not None and sender.holds_pages(self.bootstrap_room):
            sender.pump()
            return KVPoll.Transferring
        return status

    def clear(self) -> None:
        room = self.bootstrap_room
        sender = self.kv_mgr.lynx_sender
        if sender is not None and self.kv_mgr.request_status.get(room) == KVPoll.Failed:
            sender.abort(room, "the request failed on the prefill server")
        self.kv_mgr.lynx_forget_room(room)
        super().clear()


class LynxKVReceiver(MooncakeKVReceiver):
    kv_mgr: LynxKVManager
    lynx_slots: torch.Tensor | None = None  # the request's KV slots, in token order
    _lynx_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    _lynx_decoded = False
    # Speculative mode: decoded on the Anchor, the Residual still in flight; the room
    # outlives this receiver (the SpeculativeDecoder takes it over at commit).
    lynx_speculating = False
    lynx_report: RoomReport | None = None

    def send_metadata(self, kv_indices: Any, *args: Any, **kwargs: Any) -> None:
        receiver = self.kv_mgr.lynx_receiver
        assert receiver is not None
        state_indices = args[1] if len(args) > 1 else kwargs.get("state_indices")
        if state_indices and any(len(s) for s in state_indices if s is not None):
            self._lynx_fail("this model carries extra state (mamba/SWA) Lynx does not receive")
            return
        pages = np.asarray(kv_indices)
        self.lynx_slots = page_slots(pages, self.kv_mgr.lynx_page_size)
        self._lynx_call = ((kv_indices, *args), kwargs)
        self._lynx_publish()

    def _lynx_publish(self) -> bool:
        """Reserve receive space and send the metadata; False while there is none."""
        receiver = self.kv_mgr.lynx_receiver
        assert receiver is not None and self._lynx_call is not None and self.lynx_slots is not None
        try:
            offer = receiver.reserve(self.bootstrap_room, self.lynx_slots.numel(), peer=self.bootstrap_addr)
        except ReceiveCapacityError as exc:
            self._lynx_call = None
            self._lynx_fail(str(exc))
            return True
        if offer is None:
            return False
        args, kwargs = self._lynx_call
        self._lynx_call = None
        self.kv_mgr.lynx_outgoing[self.bootstrap_room] = offer
        try:
            super().send_metadata(*args, **kwargs)
        finally:
            self.kv_mgr.lynx_outgoing.pop(self.bootstrap_room, None)
        return True

    def _lynx_fail(self, reason: str) -> None:
        self.kv_mgr.record_failure(self.bootstrap_room, f"Lynx: {reason}")
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def poll(self) -> int:
        if self._lynx_call is not None and not self._lynx_publish():
            status = super().poll()
            return status if status == KVPoll.Failed else KVPoll.WaitingForInput
        status = super().poll()
        receiver = self.kv_mgr.lynx_receiver
        room = self.bootstrap_room
        if self._lynx_decoded or receiver is None or not receiver.knows(room):
            return status
        verdict, reason = receiver.verdict(room, _UPSTREAM_OF_POLL.get(status, Upstream.PENDING))
        if verdict is Verdict.WAIT:
            return KVPoll.Transferring if status == KVPoll.Success else status
        if verdict is Verdict.FAIL:
            if status != KVPoll.Failed:
                logger.error("Lynx: room %s failed: %s", room, reason)
                self._lynx_fail(reason or "transfer failed")
                self.ensure_abort_notified()
            if self.kv_mgr.lynx_metrics is not None:
                self.kv_mgr.lynx_metrics.failed()
            receiver.forget(room)
            return KVPoll.Failed
        assert self.lynx_slots is not None
        try:
            full = receiver.decode(room, self.lynx_slots)
        except Exception as exc:  # a Lynx bug (or corrupt bytes) fails this request, not the server
            logger.exception("Lynx: room %s: decoding its KV failed", room)
            self._lynx_fail(f"decoding the received KV failed: {exc}")
            self.ensure_abort_notified()
            receiver.forget(room)
            return KVPoll.Failed
        self._lynx_decoded = True
        if not full and receiver.mode == "speculative":
            self.lynx_speculating = True
            return status
        self.lynx_report = receiver.forget(room)
        if self.lynx_report is not None and self.kv_mgr.lynx_metrics is not None:
            self.kv_mgr.lynx_metrics.observe(self.lynx_report)
        return status

    def abort(self) -> None:
        self._lynx_release()
        super().abort()

    def clear(self) -> None:
        if not self.lynx_speculating:
            self._lynx_release()
        super().clear()

    def lynx_end_speculation(self) -> None:
        """The request ended at commit: nobody will verify it."""
        self.lynx_speculating = False
        self._lynx_release()

    def _lynx_release(self) -> None:
        receiver = self.kv_mgr.lynx_receiver
        if receiver is not None:
            receiver.forget(self.bootstrap_room)
        self._lynx_call = None


LYNX_CLASSES: dict[type, type] = {
    MooncakeKVManager: LynxKVManager,
    MooncakeKVSender: LynxKVSender,
    MooncakeKVReceiver: LynxKVReceiver,
}
