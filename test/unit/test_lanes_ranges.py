import pytest

from lynx.lanes.ranges import AddressError, AddressRanges


def test_add_keeps_neighbours_separate_and_covers_within_one():
    r = AddressRanges()
    r.add(100, 50)
    r.add(150, 50)
    assert r.covers(100, 50)
    assert r.covers(160, 40)
    assert not r.covers(140, 20)  # spans two buffers
    assert not r.covers(99, 2)
    assert not r.covers(190, 11)
    assert not r.covers(0, 1)


def test_add_refuses_overlap():
    r = AddressRanges()
    r.add(100, 50)
    with pytest.raises(AddressError, match="overlaps"):
        r.add(149, 10)
    with pytest.raises(AddressError, match="overlaps"):
        r.add(90, 11)
    r.add(90, 10)
    assert len(r) == 2


def test_union_merges_overlapping_and_adjacent():
    r = AddressRanges.union([(200, 10), (100, 50), (150, 20), (160, 5)])
    assert len(r) == 2
    assert r.covers(100, 70)
    assert not r.covers(100, 71)
    assert r.covers(200, 10)


def test_remove():
    r = AddressRanges()
    r.add(100, 50)
    assert r.remove(100) == 50
    assert not r.covers(100, 1)
    with pytest.raises(KeyError):
        r.remove(100)


@pytest.mark.parametrize(("start", "length"), [(-1, 10), (0, 0), (0, -5), (True, 4), (1.0, 4), (2**64, 1)])
def test_bad_spans_raise(start, length):
    with pytest.raises(AddressError):
        AddressRanges().add(start, length)
