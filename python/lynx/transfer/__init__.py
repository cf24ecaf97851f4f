"""Lynx's KV transfer between a prefill and a decode server, engine-agnostic.

* :mod:`lynx.transfer.protocol` -- the control messages and the per-request byte layout
  (the one place both sides agree on);
* :class:`ProgressiveSender` -- prefill: encode, send the Anchor on HIGH, the Residual on
  LOW, report what landed;
* :class:`ProgressiveReceiver` -- decode: receive space, what landed, write it into the KV
  pool; :mod:`lynx.transfer.receive_state` holds its per-request state machine.
"""

from lynx.transfer.arena import ArenaError, ByteArena
from lynx.transfer.protocol import (
    PROTOCOL_VERSION,
    ROOM_LIMIT,
    SEGMENT_TOKENS,
    Handshake,
    Notice,
    NoticeKind,
    Offer,
    OfferBinding,
    ProtocolError,
    RequestLayout,
    RoomError,
    Stream,
    check_room,
)
from lynx.transfer.receive_state import RECEIVE_TRANSITIONS, AuxStatus, ReceiveState, ReceiveTracker, Verdict
from lynx.transfer.receiver import (
    DuplicateRoomError,
    ProgressiveReceiver,
    ReceiveCapacityError,
    ReceiveIntegrityError,
    ReceiverStats,
    RoomReport,
)
from lynx.transfer.sender import ProgressiveSender, SenderStats, page_slots

__all__ = [
    "PROTOCOL_VERSION",
    "RECEIVE_TRANSITIONS",
    "ROOM_LIMIT",
    "SEGMENT_TOKENS",
    "ArenaError",
    "AuxStatus",
    "ByteArena",
    "DuplicateRoomError",
    "Handshake",
    "Notice",
    "NoticeKind",
    "Offer",
    "OfferBinding",
    "ProgressiveReceiver",
    "ProgressiveSender",
    "ProtocolError",
    "ReceiveCapacityError",
    "ReceiveIntegrityError",
    "ReceiveState",
    "ReceiveTracker",
    "ReceiverStats",
    "RequestLayout",
    "RoomError",
    "RoomReport",
    "SenderStats",
    "Stream",
    "Verdict",
    "check_room",
    "page_slots",
]
