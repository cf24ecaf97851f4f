"""The Mooncake connector: what Lynx's subclasses of upstream's manager, sender and
receiver read, call and override, and upstream's control messages as Lynx reads them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lynx.transfer import ROOM_LIMIT, AuxStatus
from lynx_patches.upstream.contract import (
    BASE_CONN,
    COMMON_CONN,
    CONN,
    SCHEDULER,
    Relied,
    attribute,
    method,
    relies,
)

_MANAGER = f"{CONN}.MooncakeKVManager"
_RECEIVER = f"{CONN}.MooncakeKVReceiver"
_SENDER = f"{CONN}.MooncakeKVSender"
_TRANSFER_ENGINE = (
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"
)

RELIED: tuple[Relied, ...] = (
    # What the accessors below do not declare themselves: the upstream methods Lynx's
    # subclasses of the manager, sender and receiver override or call on themselves, the
    # handlers its guard reads ahead of upstream's thread, and the fields those
    # subclasses read.
    Relied(f"{BASE_CONN}.KVPoll", "Transferring", "member"),
    Relied(f"{BASE_CONN}.KVPoll", "WaitingForInput", "member"),
    method(_MANAGER, "start_prefill_thread"),
    method(_MANAGER, "start_decode_thread"),
    method(_MANAGER, "_handle_aux_data", "msg"),
    Relied("sglang.srt.disaggregation.common.staging_handler", "handle_watermark_msg", "function"),
    Relied("sglang.srt.disaggregation.common.staging_handler", "handle_staging_rsp", "function"),
    method(_MANAGER, "__init__", "args", "disaggregation_mode", "server_args", "is_mla_backend"),
    method(_MANAGER, "_make_worker_recv", "socket", "timeout_ms"),
    method(_MANAGER, "_handle_node_failure", "failed_bootstrap_addr"),
    method(_MANAGER, "add_transfer_request", "bootstrap_room", "kv_indices", "index_slice", "is_last_chunk"),
    method(_MANAGER, "teardown"),
    method(_MANAGER, "send_aux", "req", "prefill_aux_index", "dst_aux_ptrs"),
    method(_MANAGER, "send_aux_tcp", "req", "prefill_aux_index", "dst_aux_ptrs"),
    method(_SENDER, "__init__", "mgr", "bootstrap_addr", "bootstrap_room"),
    attribute(_SENDER, "supports_host_tensor_indices"),
    method(_SENDER, "init", "num_kv_indices", "aux_index"),
    method(_SENDER, "poll"),
    method(_SENDER, "clear"),
    attribute(_SENDER, "kv_mgr"),
    attribute(_SENDER, "bootstrap_room"),
    method(_RECEIVER, "send_metadata", "kv_indices", "aux_index", "state_indices"),
    method(_RECEIVER, "poll"),
    method(_RECEIVER, "abort"),
    method(_RECEIVER, "clear"),
    method(_RECEIVER, "ensure_abort_notified", "force_arm"),
    method(_RECEIVER, "failure_exception"),
    attribute(_RECEIVER, "bootstrap_addr"),
    attribute(f"{COMMON_CONN}.PrefillServerInfo", "attn_tp_size"),
)


@dataclass(frozen=True)
class MetadataFrames:
    """Decode's per-request metadata message to prefill, as far as Lynx reads it.

    Upstream's layout (``MooncakeKVManager.build_receiver_metadata_message``): frame 0 the
    room (ASCII digits), 1 decode's host, 2 its port, 3 its Mooncake session id, 4 and 5
    its KV page ids and aux index, both empty for a dummy rank (nothing is sent to it).
    """

    room: int
    endpoint: tuple[str, int]
    session: str
    is_dummy: bool


def parse_metadata_frames(frames: Sequence[bytes]) -> MetadataFrames | None:
    """The request fields of a metadata message; None for any other message (e.g. the
    per-rank registration, whose frame 0 is not a room) and for one whose fields are not
    ASCII numbers and names, or whose room or port is out of range (a peer's garbage: read
    on upstream's bootstrap thread, which an exception would end;
    :func:`unreadable_peer_message` drops it before upstream reads it)."""
    if len(frames) < 6 or not frames[0].isdigit() or not frames[2].isdigit():
        return None
    try:
        host, session = frames[1].decode("ascii"), frames[3].decode("ascii")
        room_digits = frames[0].decode("ascii")  # isdigit() admits non-ASCII digits
        port_digits = frames[2].decode("ascii")
    except UnicodeDecodeError:
        return None
    # The lengths first: int() of a peer's million digits would take the thread's time.
    if len(room_digits) > 20 or len(port_digits) > 5:
        return None
    room, port = int(room_digits), int(port_digits)
    if room >= ROOM_LIMIT or port > 0xFFFF:
        return None
    return MetadataFrames(
        room=room,
        endpoint=(host, port),
        session=session,
        is_dummy=frames[4] == b"" and frames[5] == b"",
    )


# Messages that upstream's control threads parse and act on in one step, so they cannot be
# parsed ahead, by the side that receives them: the frames each handler reads as ASCII
# integers, those it reads as ASCII text, and its frame count (``common.staging_handler``;
# ``MooncakeKVManager._handle_aux_data``, which also unpacks frame 4 as a big-endian u32).
_READ_BY_HANDLER = {
    True: {  # prefill
        b"WATERMARK": ((1, 2), (3,), 3),
        b"STAGING_RSP": ((1, 2, 3, 4, 5), (6,), 7),
    },
    False: {  # decode
        b"STAGING_REQ": ((1,), (4,), 5),
        b"AUX_DATA": ((1, 2, 3), (), 6),
    },
}


@relies(
    Relied(COMMON_CONN, "ABORT_TAG", "member"),
    method(f"{CONN}.TransferInfo", "from_zmq", "msg"),
    method(f"{CONN}.KVArgsRegisterInfo", "from_zmq", "msg"),
    attribute(_MANAGER, "_staging_ctx"),
)
def unreadable_peer_message(manager: Any, frames: Sequence[bytes]) -> str | None:
    """Why upstream's thread on this server's control socket would raise on a peer's
    message ``frames``; None if it reads it.

    That thread (``MooncakeKVManager.start_prefill_thread`` / ``start_decode_thread``) has
    no guard: one exception ends it for good, and the server, still healthy to the router,
    then takes no new request (prefill) or no transfer status (decode). Lynx's receive hook
    asks this first and drops what upstream could not read. Where upstream's parser has no
    side effect it is run here (``TransferInfo`` / ``KVArgsRegisterInfo.from_zmq``); the
    messages of ``_READ_BY_HANDLER`` are read as their handlers read them; the rest (abort
    notifications and acks, status, ``CHUNK_READY``) upstream reads with guards of its own.
    """
    from sglang.srt.disaggregation.common.conn import ABORT_TAG
    from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo, TransferInfo

    if not frames:
        return "an empty message"
    prefill = manager_is_prefill(manager)
    head = frames[0]
    handled = _READ_BY_HANDLER[prefill].get(head)
    if handled is not None:
        integers, texts, count = handled
        name = head.decode()
        if len(frames) < count:
            return f"{name} with {len(frames)} frames, not {count}"
        digits = all(frames[i].isdigit() for i in integers)
        if not digits or not all(frames[i].isascii() for i in texts if i < len(frames)):
            return f"{name} with fields that are not ASCII"
        if head == b"AUX_DATA":
            return None if len(frames[4]) == 4 else "AUX_DATA whose length is not 4 bytes"
        staging_off = manager._staging_ctx is None
        return f"{name} while upstream's staging buffers are off" if staging_off else None
    if not prefill or head == ABORT_TAG:
        return None  # read by upstream with a guard
    try:  # upstream's own parsers: any exception is one that would end its thread
        (KVArgsRegisterInfo if head == b"None" else TransferInfo).from_zmq(list(frames))
    except Exception as exc:  # whatever they raise, the thread would die of it
        return f"a message upstream cannot parse ({type(exc).__name__}: {exc})"
    if head != b"None" and parse_metadata_frames(frames) is None:
        # upstream reads any digits as a room; Lynx (and every u64 after it) cannot
        return "a request's metadata whose room or port is out of range (a room is 0..2**64-1)"
    return None


@relies(
    Relied(COMMON_CONN, "ABORT_TAG", "member"),
    Relied(COMMON_CONN, "AbortNotification", "class"),
    method(f"{COMMON_CONN}.AbortNotification", "from_zmq", "msg"),
    attribute(f"{COMMON_CONN}.AbortNotification", "room"),
    attribute(f"{COMMON_CONN}.AbortNotification", "decode_ip"),
    attribute(f"{COMMON_CONN}.AbortNotification", "decode_port"),
)
def aborted_room(msg: Sequence[bytes]) -> tuple[int, tuple[str, int] | None] | None:
    """(room, the control endpoint it names as decode's or None) of decode's abort
    notification; None if ``msg`` is not one, or names a room outside ``[0, 2**64)``. The
    endpoint is the one decode's metadata message named (``decode_ip``, ``decode_port``:
    its ``local_ip`` and ``rank_port``)."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

    if not msg or msg[0] != ABORT_TAG or (len(msg) > 1 and len(msg[1]) > 20):
        return None
    notification = AbortNotification.from_zmq(list(msg))
    if notification is None or not 0 <= int(notification.room) < ROOM_LIMIT:
        return None
    ip, port = notification.decode_ip, notification.decode_port
    return int(notification.room), None if ip is None or port is None else (ip, int(port))


@relies(
    Relied(BASE_CONN, "KVPoll", "class"),
    Relied(f"{BASE_CONN}.KVPoll", "Success", "member"),
    Relied(f"{BASE_CONN}.KVPoll", "Failed", "member"),
)
def upstream_status(status: int) -> AuxStatus:
    """Upstream's ``KVPoll`` reduced to what Lynx's receive state needs."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if status == KVPoll.Success:
        return AuxStatus.SUCCESS
    if status == KVPoll.Failed:
        return AuxStatus.FAILED
    return AuxStatus.PENDING


@relies(
    Relied(BASE_CONN, "KVPoll", "class"),
    Relied(f"{BASE_CONN}.KVPoll", "Failed", "member"),
    attribute(f"{CONN}.TransferInfo", "is_dummy"),
    method(_MANAGER, "check_status", "bootstrap_room"),
    attribute(_MANAGER, "request_status"),
    attribute(_MANAGER, "transfer_infos"),
)
def room_is_live(manager: Any, room: int) -> bool:
    """Prefill: the request is known, not failed, and has a real (non-dummy) decode rank."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    return (
        room in manager.request_status
        and manager.check_status(room) != KVPoll.Failed
        and any(not info.is_dummy for info in manager.transfer_infos.get(room, {}).values())
    )


@relies(
    Relied(BASE_CONN, "KVPoll", "class"),
    Relied(f"{BASE_CONN}.KVPoll", "Failed", "member"),
    attribute(_MANAGER, "request_status"),
)
def room_failed(manager: Any, room: int) -> bool:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return manager.request_status.get(room) == KVPoll.Failed


@relies(method(_MANAGER, "conclude_failure", "bootstrap_room", "failure_reason"))
def fail_room(manager: Any, room: int, reason: str) -> None:
    """Fail the request on this side; upstream tells the peer (with the reason)."""
    manager.conclude_failure(bootstrap_room=room, failure_reason=reason)


@relies(
    Relied(BASE_CONN, "KVPoll", "class"),
    Relied(f"{BASE_CONN}.KVPoll", "Failed", "member"),
    method(_MANAGER, "record_failure", "bootstrap_room", "failure_reason"),
    method(_MANAGER, "update_status", "bootstrap_room", "status"),
    attribute(_RECEIVER, "kv_mgr"),
    attribute(_RECEIVER, "bootstrap_room"),
    attribute(_RECEIVER, "conclude_state"),
)
def fail_receiver(receiver: Any, reason: str) -> None:
    """Decode: fail the receiver's request now, with ``reason`` for the client."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    receiver.kv_mgr.record_failure(receiver.bootstrap_room, reason)
    receiver.kv_mgr.update_status(receiver.bootstrap_room, KVPoll.Failed)
    receiver.conclude_state = KVPoll.Failed


@relies(
    Relied(BASE_CONN, "KVPoll", "class"),
    Relied(f"{BASE_CONN}.KVPoll", "Failed", "member"),
    attribute(_RECEIVER, "_owns_bootstrap_room"),
    attribute(_RECEIVER, "abort_notified"),
    attribute(_RECEIVER, "conclude_state"),
)
def fail_receiver_alone(receiver: Any) -> None:
    """Decode: fail the receiver's request without touching its room's state, which is
    another request's (status, failure record, prefill's side): the receiver gives the
    room up as upstream's own duplicate-room check does (``CommonKVReceiver.__init__``),
    and never sends prefill an abort for it. Its reason comes from
    :func:`receiver_failure` in the receiver's ``failure_exception``."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    receiver._owns_bootstrap_room = False
    receiver.abort_notified = True
    receiver.conclude_state = KVPoll.Failed


@relies(
    Relied(COMMON_CONN, "KVTransferError", "class"),
    attribute(_RECEIVER, "bootstrap_room"),
)
def receiver_failure(receiver: Any, reason: str) -> Exception:
    """What a failed receiver's ``failure_exception`` raises: the request fails with ``reason``."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    return KVTransferError(receiver.bootstrap_room, reason)


@relies(
    Relied("sglang.srt.utils.network", "NetworkAddress", "class"),
    method("sglang.srt.utils.network.NetworkAddress", "to_tcp"),
    method("sglang.srt.utils.network.NetworkAddress", "is_ipv6"),
    method(_MANAGER, "_send_multipart_locked", "endpoint", "parts", "is_ipv6"),
)
def send_to_peer(manager: Any, endpoint: tuple[str, int], frames: list[bytes]) -> None:
    """Send ``frames`` on upstream's ZMQ socket to a peer's control endpoint."""
    from sglang.srt.utils.network import NetworkAddress

    address = NetworkAddress(*endpoint)
    manager._send_multipart_locked(address.to_tcp(), frames, is_ipv6=address.is_ipv6)


@relies(
    attribute(_MANAGER, "engine"),
    method(_TRANSFER_ENGINE, "get_session_id"),
    attribute(_TRANSFER_ENGINE, "engine"),
)
def manager_transfer_engine(manager: Any) -> tuple[Any, str]:
    """(the Mooncake ``TransferEngine``, this server's session id)."""
    return manager.engine.engine, manager.engine.get_session_id()


@relies(
    attribute(f"{COMMON_CONN}.CommonKVManager", "local_ip"),
    attribute(f"{COMMON_CONN}.CommonKVManager", "rank_port"),
)
def control_endpoint(manager: Any) -> str:
    """The ZMQ endpoint where the manager receives its peers' messages."""
    return f"tcp://{manager.local_ip}:{manager.rank_port}"


@relies(
    attribute(_MANAGER, "engine"),
    method(_TRANSFER_ENGINE, "register", "ptr", "length"),
)
def register_receive_buffer(manager: Any, address: int, nbytes: int) -> None:
    manager.engine.register(address, nbytes)


@relies(attribute(f"{BASE_CONN}.KVArgs", "page_size"), attribute(_MANAGER, "kv_args"))
def manager_page_size(manager: Any) -> int:
    return int(manager.kv_args.page_size)


@relies(attribute(f"{BASE_CONN}.KVArgs", "engine_rank"), attribute(_MANAGER, "kv_args"))
def manager_engine_rank(manager: Any) -> int:
    return int(manager.kv_args.engine_rank)


@relies(attribute(f"{COMMON_CONN}.CommonKVManager", "attn_tp_size"))
def manager_attn_tp_size(manager: Any) -> int:
    """How many attention-TP ranks this server's KV heads are split over."""
    return int(manager.attn_tp_size)


@relies(
    attribute("sglang.srt.managers.tp_worker.TpModelWorker", "random_seed"),
    attribute(SCHEDULER, "tp_worker"),
)
def random_seed(scheduler: Any) -> int:
    """The scheduler's random seed: its model worker broadcasts one seed to every TP rank,
    which upstream's sampler relies on."""
    return int(scheduler.tp_worker.random_seed)


@relies(attribute(_RECEIVER, "prefill_info"))
def peer_attn_tp_size(receiver: Any) -> int | None:
    """Decode, after ``init``: the attention-TP size of the receiver's prefill server (None
    if upstream never learnt it: its request has failed already)."""
    info = getattr(receiver, "prefill_info", None)
    return None if info is None else int(info.attn_tp_size)


@relies(
    Relied("sglang.srt.disaggregation.utils", "all_reduce_flags", "function"),
    attribute(SCHEDULER, "attn_tp_cpu_group"),
)
def rank_reduce_min(scheduler: Any) -> Callable[[list[int]], list[int]]:
    """Elementwise MIN over the scheduler's attention-TP ranks (gloo, as upstream reduces
    its transfer polls); the identity on one rank."""
    import torch.distributed as dist
    from sglang.srt.disaggregation.utils import all_reduce_flags

    group = scheduler.attn_tp_cpu_group
    return lambda flags: all_reduce_flags(flags, group, dist.ReduceOp.MIN)


@relies(
    Relied("sglang.srt.disaggregation.utils", "DisaggregationMode", "class"),
    Relied("sglang.srt.disaggregation.utils.DisaggregationMode", "PREFILL", "member"),
    attribute(_MANAGER, "disaggregation_mode"),
)
def manager_is_prefill(manager: Any) -> bool:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return manager.disaggregation_mode == DisaggregationMode.PREFILL


@relies(attribute(_MANAGER, "is_mla_backend"))
def manager_is_mla(manager: Any) -> bool:
    return bool(manager.is_mla_backend)


@relies(attribute("sglang.srt.server_args.ServerArgs", "enable_metrics"), attribute(_MANAGER, "server_args"))
def metrics_enabled(manager: Any) -> bool:
    return bool(getattr(manager.server_args, "enable_metrics", False))


def synchronize_send_events(kwargs: dict[str, Any]) -> None:
    """Prefill's send path may pass CUDA events that order the page-index copy; Lynx
    encodes on the scheduler thread, so it waits for them here (and upstream gets none)."""
    for name in ("wait_event", "indices_event"):
        event = kwargs.pop(name, None)
        if event is not None:
            event.synchronize()


def metadata_state_indices(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``state_indices`` of ``MooncakeKVReceiver.send_metadata(kv_indices, aux_index, state_indices)``."""
    return args[1] if len(args) > 1 else kwargs.get("state_indices")


@relies(method(_MANAGER, "build_receiver_metadata_message", "bootstrap_room", "is_dummy"))
def metadata_frames_violation() -> str | None:
    """Whether upstream's metadata message still has the layout
    :func:`parse_metadata_frames` reads (built by upstream's own method)."""
    from types import SimpleNamespace

    import numpy as np
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    fake = SimpleNamespace(local_ip="10.1.2.3", rank_port=4567, get_session_id=lambda: "10.1.2.3:9999")
    build = MooncakeKVManager.build_receiver_metadata_message
    fields = {"required_dst_info_num": 1, "state_indices": None, "decode_prefix_len": 0}
    real = build(
        fake, bootstrap_room=42, kv_indices=np.array([1, 2], np.int32), aux_index=3, is_dummy=False, **fields
    )
    dummy = build(
        fake, bootstrap_room=43, kv_indices=np.array([], np.int32), aux_index=None, is_dummy=True, **fields
    )
    want = (
        MetadataFrames(42, ("10.1.2.3", 4567), "10.1.2.3:9999", False),
        MetadataFrames(43, ("10.1.2.3", 4567), "10.1.2.3:9999", True),
    )
    got = (parse_metadata_frames(real), parse_metadata_frames(dummy))
    return (
        None if got == want else f"metadata frames parse as {got}, expected {want} (frames {real}, {dummy})"
    )
