"""Byte ranges of one registered buffer, handed out to requests and taken back.

Both servers keep one: prefill encodes a request's Anchor and Residual into its send
buffer, decode lends a request receive space in its own. First fit over a sorted free
list; neighbours are merged on free. Thread-safe (decode frees from its ZMQ thread when a
peer reports its writes are over).
"""

from __future__ import annotations

import bisect
import threading

import torch

ALIGN = 64  # a cache line; also keeps every region 16-byte aligned as the codec wants


class ArenaError(ValueError):
    """A free of something that was not handed out."""


class ByteArena:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"arena capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._free_starts: list[int] = [0]
        self._free_ends: list[int] = [capacity]
        self._taken: dict[int, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def rounded(nbytes: int) -> int:
        return -(-nbytes // ALIGN) * ALIGN

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._taken.values())

    def allocate(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` (rounded up to ALIGN), or None if no gap is large enough."""
        if nbytes <= 0:
            raise ValueError(f"allocate needs a positive size, got {nbytes}")
        size = self.rounded(nbytes)
        with self._lock:
            for i, (start, end) in enumerate(zip(self._free_starts, self._free_ends, strict=True)):
                if end - start >= size:
                    if end - start == size:
                        del self._free_starts[i], self._free_ends[i]
                    else:
                        self._free_starts[i] = start + size
                    self._taken[start] = size
                    return start
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._taken.pop(offset, None)
            if size is None:
                raise ArenaError(f"offset {offset} was not allocated (or was freed twice)")
            start, end = offset, offset + size
            i = bisect.bisect_left(self._free_starts, start)
            if i > 0 and self._free_ends[i - 1] == start:
                i -= 1
                start = self._free_starts[i]
                del self._free_starts[i], self._free_ends[i]
            if i < len(self._free_starts) and self._free_starts[i] == end:
                end = self._free_ends[i]
                del self._free_starts[i], self._free_ends[i]
            self._free_starts.insert(i, start)
            self._free_ends.insert(i, end)


def arena_over(buffer: torch.Tensor, what: str) -> ByteArena:
    """The arena of a send or receive buffer, which must be flat bytes (it is registered
    with the transfer engine as one region)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"the {what} buffer must be a contiguous 1-D uint8 tensor")
    return ByteArena(buffer.numel())
