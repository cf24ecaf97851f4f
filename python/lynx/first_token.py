"""Decode streams a request's first token (``t_0``, sampled by prefill at full precision)
before the request joins a batch: as soon as prefill's aux data lands (every Lynx mode,
while its KV is still on the way), or, in speculative mode, when it waits for its Residual
out of every batch. The engine's own path streams ``t_0`` again when the request joins a
batch: that chunk would carry no new token, and is left out (see
:meth:`StreamedAhead.take`).

Contract: scheduler thread only (no lock).
"""

from __future__ import annotations

import weakref
from typing import Any


class StreamedAhead:
    """The requests whose ``t_0`` streamed before they joined a batch. Held weakly: a
    request that ends before it joins one leaves no mark behind."""

    def __init__(self) -> None:
        self._reqs: weakref.WeakSet[Any] = weakref.WeakSet()

    def __bool__(self) -> bool:
        return len(self._reqs) > 0

    def add(self, req: Any) -> None:
        self._reqs.add(req)

    def take(self, req: Any) -> bool:
        """Whether ``req`` streamed ahead; the mark is used up (the engine's first stream
        of it is the one to leave out, not a later one)."""
        if req in self._reqs:
            self._reqs.discard(req)
            return True
        return False
