"""Runs in a fresh interpreter: Lynx's Mooncake sender and receiver subclasses, on real
Lynx core objects, with a stand-in for upstream's manager (no engine, no sockets).

Prints ``PROBE-RESULT <json>``: what each case observed.
"""

import inspect
import json
import logging
from collections.abc import Sequence
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from lynx_patches import sgl_kernel
from lynx_patches._hooks import is_cpu_engine

if is_cpu_engine():
    sgl_kernel.install()

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, KVTransferError
from sglang.srt.disaggregation.common.utils import pack_int_lists
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVReceiver
from sglang.srt.disaggregation.utils import DisaggregationMode

from lynx.codec import CodecConfig, KVLayout
from lynx.lanes import BatchState, LaneConfig, Transfer
from lynx.threads import Survivor
from lynx.transfer import AuxStatus, Handshake, Notice, ProgressiveReceiver, ProgressiveSender, Verdict
from lynx_patches import upstream
from lynx_patches.mooncake_connector import RECEIVER_STEPS, LynxKVManager, LynxKVReceiver, LynxKVSender
from lynx_patches.runtime import LynxManagerRole, LynxReceiverRole

ROOM = 4242
PAGES = 6
PAGE_SIZE = 4
HANDSHAKE = Handshake("full", CodecConfig(), KVLayout(2, 2, 64, torch.bfloat16))


def kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return (
        [torch.zeros(64, 2, 64, dtype=torch.bfloat16) for _ in range(2)],
        [torch.zeros(64, 2, 64, dtype=torch.bfloat16) for _ in range(2)],
    )


def receiver_glue(manager: SimpleNamespace) -> LynxKVReceiver:
    """A LynxKVReceiver as upstream's constructor leaves it, minus the network."""
    glue = object.__new__(LynxKVReceiver)
    glue.kv_mgr = manager
    glue.bootstrap_room = ROOM
    glue.bootstrap_addr = "10.0.0.1:8998"
    glue.conclude_state = None
    glue.abort_notified = False
    return glue


def duplicate_room() -> dict:
    """A second request for a room decode already reserved fails alone."""
    k, v = kv()
    receiver = ProgressiveReceiver(
        buffer=torch.zeros(1 << 20, dtype=torch.uint8),
        k_buffers=k,
        v_buffers=v,
        handshake=HANDSHAKE,
        deadline_s=60.0,
    )
    manager = SimpleNamespace(
        lynx=SimpleNamespace(receiver=receiver, page_size=PAGE_SIZE, metrics=None),
        request_status={ROOM: KVPoll.WaitingForInput},
        failure_records={},
    )
    receiver.register(ROOM, PAGES * PAGE_SIZE, peer="10.0.0.1:8998")  # the first request's
    first = receiver.reserve(ROOM)
    second = receiver_glue(manager)
    second.send_metadata(np.arange(PAGES, dtype=np.int32), 0, None)  # old: raised in the scheduler
    polled = second.poll()
    try:
        second.failure_exception()
        raised = None
    except KVTransferError as exc:
        raised = exc.failure_reason
    second.abort()
    second.clear()
    return {
        "polled_failed": polled == KVPoll.Failed,
        "reason": raised,
        "first_kept": receiver.verdict(ROOM, AuxStatus.PENDING) == (Verdict.WAIT, None),
        "first_offer_kept": first is not None and receiver.reserve(ROOM) == first,
        "room_status_kept": manager.request_status == {ROOM: KVPoll.WaitingForInput},
        "failure_records": manager.failure_records,
        "abort_sent": not second.abort_notified,
        "second_step": second.lynx_step.value,  # it never took the room, so never gives it up
    }


class NoEngine:
    session_id = "prefill:1"

    def probe(self, peer: str) -> bool:
        return True

    def register_memory(self, addr: int, length: int) -> None:
        pass

    def unregister_memory(self, addr: int) -> None:
        pass

    def submit_write(self, peer: str, transfers: Sequence[Transfer]) -> object:
        return object()

    def poll(self, handle: object) -> BatchState:
        return BatchState.PENDING


def prefill_sizes_the_room(pages: int) -> dict:
    """``init`` gives the sender the request's length (whole pages, as decode counts
    slots): the offer waiting for it is answered then, against that length."""
    k, v = kv()
    decode = ProgressiveReceiver(
        buffer=torch.zeros(1 << 20, dtype=torch.uint8),
        k_buffers=k,
        v_buffers=v,
        handshake=HANDSHAKE,
        deadline_s=60.0,
    )
    decode.register(ROOM, PAGES * PAGE_SIZE, peer="10.0.0.1:8998")
    offer = decode.reserve(ROOM)
    assert offer is not None
    notices: list[Notice] = []
    sender = ProgressiveSender(
        backend=NoEngine(),
        buffer=torch.zeros(1 << 20, dtype=torch.uint8),
        k_buffers=k,
        v_buffers=v,
        page_size=PAGE_SIZE,
        handshake=HANDSHAKE,
        lane_config=LaneConfig(),
        notify=lambda endpoint, frames: notices.append(Notice.from_frames(frames)),
        on_failure=lambda room, reason: None,
    )
    try:
        answered_early = sender.take_offer(ROOM, offer.to_wire(), ("10.0.0.2", 9000), "decode:1")
        glue = object.__new__(LynxKVSender)
        glue.kv_mgr = SimpleNamespace(lynx=SimpleNamespace(sender=sender, page_size=PAGE_SIZE))
        glue.bootstrap_room = ROOM
        glue.init(pages, 0)
        return {
            "answered_early": answered_early is not None,
            "notices": [(n.kind.name, n.nonce == offer.nonce, n.text) for n in notices],
            "refusal": sender.refusal(ROOM),
        }
    finally:
        sender.close()


def peer_messages() -> dict:
    """What ``upstream.unreadable_peer_message`` says of decode's messages on a prefill
    server and of prefill's on a decode server (None: upstream's thread may read it)."""
    request = [b"42", b"10.0.0.1", b"7000", b"10.0.0.1:9", np.arange(3, dtype=np.int32).tobytes(), b"3"]
    request += [pack_int_lists([], "i"), b"1"]
    registration = [b"None", b"10.0.0.1", b"7000", b"10.0.0.1:9", b"\0" * 16, b"\0" * 8]
    registration += [pack_int_lists([], "Q"), b"0", b"1", b"1024"]
    to_prefill = {
        "request": request,
        "registration": registration,
        "abort": [ABORT_TAG, b"42"],
        "empty": [],
        "one garbage frame": [b"\xff" * 64],
        "huge frame": [b"7" * (32 << 20)],
        "request, port not a number": [*request[:2], b"x", *request[3:]],
        "request, host not ASCII": [request[0], b"\xff", *request[2:]],
        "request, 5 index bytes": [*request[:4], b"12345", *request[5:]],
        "request, frames cut": request[:5],
        "request, room 2**64": [str(1 << 64).encode(), *request[1:]],
        "request, room -1": [b"-1", *request[1:]],
        "registration, frames cut": registration[:6],
        "watermark while staging is off": [b"WATERMARK", b"1", b"2"],
        "watermark, not digits": [b"WATERMARK", b"x", b"2"],
        "aux data": [b"AUX_DATA", b"1", b"0", b"0", b"\0\0\0\1", b"x"],
    }
    to_decode = {
        "status": [b"42", b"2", b"0"],
        "garbage": [b"\xff" * 64],
        "aux data": [b"AUX_DATA", b"1", b"0", b"0", b"\0\0\0\1", b"x"],
        "aux data, room not a number": [b"AUX_DATA", b"x", b"0", b"0", b"\0\0\0\1", b"x"],
        "aux data, length of 3 bytes": [b"AUX_DATA", b"1", b"0", b"0", b"\0\0\1", b"x"],
        "aux data, frames cut": [b"AUX_DATA", b"1"],
        "staging request while staging is off": [b"STAGING_REQ", b"1", b"0", b"0", b"s"],
    }
    sides = {
        "prefill": (DisaggregationMode.PREFILL, to_prefill),
        "decode": (DisaggregationMode.DECODE, to_decode),
    }
    return {
        side: {
            name: upstream.unreadable_peer_message(
                SimpleNamespace(disaggregation_mode=mode, _staging_ctx=None), frames
            )
            for name, frames in messages.items()
        }
        for side, (mode, messages) in sides.items()
    }


class BuggySender:
    """A Lynx bug on prefill's bootstrap thread: every offer raises."""

    def take_metadata(self, *args: object) -> bool:
        raise RuntimeError("a Lynx bug taking an offer")

    def take_abort(self, room: int, peer: object) -> bool:
        return room != 7  # with a key: room 7's ABORT names another decode


class BuggyReceiver:
    """A Lynx bug on decode's status thread: every notice raises."""

    def on_message(self, frames: list[bytes]) -> bool:
        if frames and frames[0] == b"LYNX1":
            raise RuntimeError("a Lynx bug reading a notice")
        return False


def control_hook() -> dict:
    """What upstream's bootstrap (prefill) and status (decode) threads read through Lynx's
    hook from a run of peer messages: None for a message dropped, else the frames' count.
    Old: an exception of Lynx's own ended the thread; the hook now drops that message."""
    request = [b"42", b"10.0.0.1", b"7000", b"10.0.0.1:9", np.arange(3, dtype=np.int32).tobytes(), b"3"]
    request += [pack_int_lists([], "i"), b"1"]
    runs = {
        "prefill": (
            DisaggregationMode.PREFILL,
            SimpleNamespace(receiver=None, sender=BuggySender()),
            [
                [str(1 << 64).encode(), *request[1:]],  # unreadable: dropped before anything
                [*request, b"LYNX1", b"offer"],  # take_offer raises: dropped, thread goes on
                [ABORT_TAG, b"7", b"10.0.0.66", b"9"],  # not the room's decode: dropped
                [ABORT_TAG, b"8", b"10.0.0.1", b"7000"],
            ],
        ),
        "decode": (
            DisaggregationMode.DECODE,
            SimpleNamespace(receiver=BuggyReceiver(), sender=None),
            [[b"LYNX1", b"LANDED", b"x"], [b"42", b"2", b"0"]],
        ),
    }
    out = {}
    for side, (mode, lynx, messages) in runs.items():
        manager = object.__new__(LynxKVManager)
        manager.lynx, manager.disaggregation_mode, manager._staging_ctx = lynx, mode, None
        manager.local_ip, manager.rank_port = "10.0.0.9", 1
        manager.lynx_unreadable_messages = 0
        manager.lynx_survivor = Survivor(logging.getLogger("probe"), "control-message hook")
        queue = list(messages)

        def upstream_recv(self: object, socket: object, timeout_ms: int = 500, queue: list = queue) -> object:
            return lambda: queue.pop(0)

        with mock.patch.object(MooncakeKVManager, "_make_worker_recv", upstream_recv):
            recv = manager._make_worker_recv(None)
        read = [recv() for _ in messages]
        out[side] = {
            "read": [None if frames is None else len(frames) for frames in read],
            "survived": manager.lynx_survivor.count,
            "unreadable": manager.lynx_unreadable_messages,
        }
    return out


print(
    "PROBE-RESULT "
    + json.dumps(
        {
            "duplicate_room": duplicate_room(),
            "receiver_steps": {
                step.value: sorted(later.value for later in after) for step, after in RECEIVER_STEPS.items()
            },
            "same_length": prefill_sizes_the_room(PAGES),
            "other_length": prefill_sizes_the_room(PAGES + 1),
            "peer_messages": peer_messages(),
            "control_hook": control_hook(),
            # what the hooks find the connector's classes by (plays the role, leaves none of
            # it abstract); upstream's own classes play none
            "roles": {
                cls.__name__: [issubclass(cls, role) and not inspect.isabstract(cls) for role in roles]
                for cls in (LynxKVManager, LynxKVReceiver, MooncakeKVManager, MooncakeKVReceiver)
                for roles in [(LynxManagerRole, LynxReceiverRole)]
            },
        }
    )
)
