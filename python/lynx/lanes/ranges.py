"""Address ranges: which bytes a transfer may read from and write to.

The engine does not protect us: over TCP it never checks the source address, and it
accepts any destination inside *any* buffer the peer registered, including pages that
belong to another request. So every transfer is checked here, before it is queued.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class AddressError(ValueError):
    """A transfer reads or writes outside the memory it was given."""


def check_span(what: str, start: int, length: int) -> None:
    """Raise `AddressError` unless `[start, start + length)` is a non-empty address span."""
    for name, value in (("address", start), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise AddressError(f"{what}: {name} must be an int, got {value!r}")
    if start < 0 or length <= 0 or start + length > 2**64:
        raise AddressError(f"{what}: invalid span 0x{start:x}+{length}")


class AddressRanges:
    """A set of disjoint address spans with a containment test.

    `add` keeps spans separate (a source must lie inside one registered buffer: an RDMA
    memory region does not extend into its neighbour); `union` merges overlapping and
    adjacent spans (a destination grant is a set of bytes, pages may be contiguous).
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    @classmethod
    def union(cls, spans: Iterable[tuple[int, int]]) -> AddressRanges:
        merged: list[list[int]] = []
        for start, length in sorted(spans):
            check_span("destination range", start, length)
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], start + length)
            else:
                merged.append([start, start + length])
        ranges = cls()
        for start, end in merged:
            ranges.add(start, end - start)
        return ranges

    def add(self, start: int, length: int) -> None:
        check_span("range", start, length)
        i = bisect.bisect_right(self._starts, start)
        if (i > 0 and self._ends[i - 1] > start) or (
            i < len(self._starts) and self._starts[i] < start + length
        ):
            raise AddressError(f"range 0x{start:x}+{length} overlaps a registered range")
        self._starts.insert(i, start)
        self._ends.insert(i, start + length)

    def remove(self, start: int) -> int:
        """Drop the span that starts at `start`; return its length."""
        i = bisect.bisect_left(self._starts, start)
        if i == len(self._starts) or self._starts[i] != start:
            raise KeyError(f"no range starts at 0x{start:x}")
        del self._starts[i]
        return self._ends.pop(i) - start

    def covers(self, start: int, length: int) -> bool:
        """True if `[start, start + length)` lies inside a single span."""
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + length <= self._ends[i]

    def __len__(self) -> int:
        return len(self._starts)
