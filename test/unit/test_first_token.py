"""The requests whose first token streamed before they joined a batch."""

from __future__ import annotations

import gc

from lynx.first_token import StreamedAhead


class Request:
    pass


def test_a_mark_is_taken_once_by_the_request_itself() -> None:
    ahead, req, other = StreamedAhead(), Request(), Request()
    assert not ahead
    ahead.add(req)
    assert ahead
    assert not ahead.take(other)  # another request, however alike
    assert ahead.take(req)
    assert not ahead.take(req)  # the engine's first stream of it is the one left out
    assert not ahead


def test_a_request_that_ends_before_a_batch_leaves_no_mark() -> None:
    ahead = StreamedAhead()
    req = Request()
    ahead.add(req)
    del req
    gc.collect()
    assert not ahead
