"""Bootstrap rooms for the parallel samples of one request (``n`` > 1).

A PD router gives a request one bootstrap room and sends the request, ``n`` included, to
a prefill and a decode server. Each server's tokenizer then sends its scheduler, per
prompt, first a prefix-cache warm-up (``max_new_tokens`` 0) and then the ``n`` samples,
every one with the prompt's room; a room names one transfer between one pair of
requests, so the second sample's room is taken (Lynx's receiver refuses it, upstream's
waits forever). Both servers see the same sends in the same order, so each can name
them alike on its own, with no message between them:

* the warm-up transfers nothing: both servers run it on upstream's fake transfer (its
  output is never read, and it would put the prompt's KV on the link once more);
* sample ``k`` (1..n) gets :func:`sample_room` of the prompt's room and ``k``.

:class:`ParallelSampleRooms` counts the sends of each registered room; it is the
tokenizer's, one per server process (``lynx_patches.tokenizer_manager``).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass

# Upstream's rooms are non-negative 63-bit integers (the router draws them so).
_ROOM_BITS = 63
_ROOM_AND_SAMPLE = struct.Struct("<QQ")
_PERSON = b"lynx-sample-room"


def sample_room(room: int, sample: int) -> int:
    """The room of sample ``sample`` (1-based) of the request whose room is ``room``: a
    keyed hash, so it collides with another request's room no more often than two drawn
    rooms do (and never equals ``room + i``, the rooms upstream numbers a batch with)."""
    if not 0 <= room < 1 << 64:
        raise ValueError(f"a bootstrap room is an unsigned 64-bit integer, got {room}")
    if sample < 1:
        raise ValueError(f"samples are numbered from 1, got {sample}")
    digest = hashlib.blake2b(_ROOM_AND_SAMPLE.pack(room, sample), digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little") >> (64 - _ROOM_BITS)


@dataclass(frozen=True)
class SampleSend:
    """What one send of a parallel-sampling request is: the warm-up (``room`` unchanged,
    nothing transferred) or a sample with its own ``room``."""

    warmup: bool
    room: int


class ParallelSampleRooms:
    """The sends seen so far of each parallel-sampling request in flight, by its room."""

    def __init__(self) -> None:
        self._sends: dict[int, int] = {}

    def begin(self, rooms: list[int]) -> None:
        """A request with these prompt rooms starts sending its warm-ups and samples.
        Raises ValueError if one is in flight already (two requests given one room)."""
        repeated = {room for room, count in Counter(rooms).items() if count > 1}
        taken = sorted({room for room in rooms if room in self._sends} | repeated)
        if taken:
            raise ValueError(
                f"bootstrap room(s) {taken} already belong to a parallel-sampling request in "
                "flight on this server: each request needs its own room"
            )
        self._sends.update(dict.fromkeys(rooms, 0))

    def end(self, rooms: list[int]) -> None:
        """The request is answered (or gone): forget its rooms."""
        for room in rooms:
            self._sends.pop(room, None)

    def next_send(self, room: int | None) -> SampleSend | None:
        """What the next send with ``room`` is, or None if no parallel-sampling request in
        flight has that room (the send is left as it is)."""
        if room is None or room not in self._sends:
            return None
        index = self._sends[room]
        self._sends[room] = index + 1
        if index == 0:
            return SampleSend(warmup=True, room=room)
        return SampleSend(warmup=False, room=sample_room(room, index))

    def in_flight(self) -> int:
        return len(self._sends)
