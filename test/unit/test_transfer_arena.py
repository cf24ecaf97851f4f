"""ByteArena: first fit over a sorted free list, aligned, neighbours merged on free."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx.transfer import ArenaError, ByteArena
from lynx.transfer.arena import ALIGN


def test_align_is_a_cache_line_and_sizes_round_up() -> None:
    assert ALIGN == 64
    assert [ByteArena.rounded(n) for n in (1, 63, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, 192]


def test_rejects_empty_arenas_and_sizes() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ByteArena(0)
    arena = ByteArena(1024)
    for size in (0, -64):
        with pytest.raises(ValueError, match="positive size"):
            arena.allocate(size)


def test_allocations_are_aligned_back_to_back_and_counted_rounded() -> None:
    arena = ByteArena(1024)
    assert arena.allocate(1) == 0
    assert arena.allocate(100) == 64
    assert arena.allocate(64) == 192
    assert arena.used == 64 + 128 + 64
    assert arena.capacity == 1024


def test_first_fit_takes_the_lowest_gap_that_is_large_enough() -> None:
    arena = ByteArena(64 * 10)
    a, b, c, d = (arena.allocate(64 * n) for n in (1, 2, 1, 3))
    assert (a, b, c, d) == (0, 64, 192, 256)
    arena.free(b)  # gap of 2 at 64
    arena.free(d)  # gap of 3 at 256, merged with the tail: 6 at 256
    assert arena.allocate(64) == 64  # first gap, though smaller than the later one
    assert arena.allocate(128) == 256  # the rest of the first gap (64) is too small
    assert arena.allocate(64) == 128  # now the first gap fits
    assert arena.allocate(64 * 4) == 384
    assert arena.allocate(1) is None
    assert arena.used == arena.capacity


def test_none_when_no_gap_is_large_enough() -> None:
    arena = ByteArena(256)
    assert arena.allocate(257) is None
    first = arena.allocate(128)
    second = arena.allocate(128)
    assert arena.allocate(1) is None
    assert arena.used == 256
    arena.free(first)
    assert arena.allocate(129) is None  # 128 free in total, but not 192
    assert arena.allocate(128) == first
    arena.free(second)
    assert arena.used == 128


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2), (2, 0, 3, 1), (0, 2, 1, 3)])
def test_freeing_everything_in_any_order_coalesces_into_one_gap(order: tuple[int, ...]) -> None:
    arena = ByteArena(64 * 8)
    offsets = [arena.allocate(n) for n in (64, 128, 64, 256)]
    assert arena.used == arena.capacity
    for i in order:
        arena.free(offsets[i])  # type: ignore[arg-type]
    assert arena.used == 0
    assert arena.allocate(arena.capacity) == 0


def test_double_free_and_unknown_offsets_raise() -> None:
    arena = ByteArena(1024)
    offset = arena.allocate(64)
    assert offset is not None
    arena.free(offset)
    with pytest.raises(ArenaError, match="freed twice"):
        arena.free(offset)
    other = arena.allocate(128)
    assert other == 0
    with pytest.raises(ArenaError, match="offset 64 was not allocated"):
        arena.free(64)  # inside a live allocation, not its start
    assert arena.used == 128
    assert issubclass(ArenaError, ValueError)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 64).map(lambda n: n * ALIGN),
    st.lists(st.tuples(st.booleans(), st.integers(1, 20 * ALIGN), st.integers(0, 1 << 16)), max_size=60),
)
def test_random_alloc_free_sequences_keep_ranges_disjoint(
    capacity: int, steps: list[tuple[bool, int, int]]
) -> None:
    arena = ByteArena(capacity)
    live: dict[int, int] = {}  # offset -> rounded size
    for do_free, nbytes, pick in steps:
        if do_free and live:
            offset = sorted(live)[pick % len(live)]
            arena.free(offset)
            del live[offset]
        else:
            offset = arena.allocate(nbytes)
            size = ByteArena.rounded(nbytes)
            if offset is None:
                # First fit only refuses when no gap between live ranges is large enough.
                edges = [0, *(e for o in sorted(live) for e in (o, o + live[o])), capacity]
                gaps = [edges[i + 1] - edges[i] for i in range(0, len(edges), 2)]
                assert max(gaps) < size
            else:
                assert offset % ALIGN == 0
                assert offset >= 0 and offset + size <= capacity
                for other, other_size in live.items():
                    assert offset + size <= other or other + other_size <= offset
                # First fit: no earlier gap could hold it.
                below = [0, *(e for o in sorted(live) if o < offset for e in (o, o + live[o]))]
                for i in range(0, len(below) - 1, 2):
                    assert below[i + 1] - below[i] < size
                live[offset] = size
        assert arena.used == sum(live.values())
    for offset in list(live):
        arena.free(offset)
    assert arena.used == 0
    assert arena.allocate(capacity) == 0
