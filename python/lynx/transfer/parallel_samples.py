"""Bootstrap rooms for the parallel samples of one request (``n`` > 1), and which requests
need their prompt's KV on decode.

A PD router gives a request one bootstrap room and sends the request, ``n`` included, to
a prefill and a decode server. Each server's tokenizer then sends its scheduler, per
prompt, first a prefix-cache warm-up (``max_new_tokens`` 0), waits for its answer, and
then sends the ``n`` samples, every one with the prompt's room; a room names one
transfer between one pair of requests, so the second sample's room is taken (Lynx's
receiver refuses it, upstream's waits forever). Both servers see the same sends in the
same order, so each can name them alike on its own, with no message between them:

* the warm-up keeps the prompt's room and is a transfer like any other;
* sample ``k`` (1..n) gets :func:`sample_room` of the prompt's room and ``k``.

What the warm-up moves is decode's choice (:func:`decode_reads_prompt_kv`): a decode
server with a radix cache (``--disaggregation-decode-enable-radix-cache``) receives the
prompt's KV once, keeps it when the warm-up ends, and asks prefill for each sample's
tokens past that prefix only (upstream's ``decode_prefix_len``): the prompt crosses the
link once per request. A decode server without one would drop the warm-up's KV unread,
so it asks for none of it, and each sample's transfer carries the prompt.

:class:`ParallelSampleRooms` counts the sends of each registered room; it is the
tokenizer's, one per server process (``lynx_patches.tokenizer_manager``).
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter

# Upstream's rooms are non-negative 63-bit integers (the router draws them so).
_ROOM_BITS = 63
_ROOM_AND_SAMPLE = struct.Struct("<QQ")
_PERSON = b"lynx-sample-room"


def decode_reads_prompt_kv(max_new_tokens: int | None, decode_radix_cache: bool) -> bool:
    """Whether a decode server needs the prompt's KV of a request that generates at most
    ``max_new_tokens`` tokens (None: no limit). A request of none (the warm-up of
    parallel samples) ends on prefill's first token and never reads it, unless decode's
    radix cache keeps it for the requests after it."""
    return decode_radix_cache or max_new_tokens != 0


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

    def next_send(self, room: int | None) -> int | None:
        """The room the next send with ``room`` goes with: its sample's, or None to leave
        the send as it is (the warm-up, or no parallel-sampling request in flight has
        that room)."""
        if room is None or room not in self._sends:
            return None
        index = self._sends[room]
        self._sends[room] = index + 1
        return None if index == 0 else sample_room(room, index)

    def in_flight(self) -> int:
        return len(self._sends)
