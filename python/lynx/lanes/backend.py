"""The transfer-engine interface the lanes drive, and the value types they share.

The lanes never talk to a transfer engine directly: they go through `TransferBackend`, so
the scheduling logic is engine-agnostic and unit-testable with a fake. `MooncakeBackend`
(in `lynx.lanes.mooncake`) is the real implementation.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol


class Transfer(NamedTuple):
    """One one-sided write: `length` bytes from local address `src` to peer address `dst`."""

    src: int
    dst: int
    length: int


class BatchState(enum.Enum):
    """What polling a submitted batch can say. A batch is resolved once it is not PENDING."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferBackendError(RuntimeError):
    """The engine refused an operation outside a transfer (initialise, register memory)."""


class TransferBackend(Protocol):
    """A one-sided write engine with non-blocking submission and polling.

    `submit_write` must not block on the transfer itself, and must report an engine-side
    refusal through `poll` (FAILED) rather than by raising, so that a partially submitted
    batch is still tracked until every part of it has resolved. The handle is opaque to
    the caller; `poll` is called on it until it resolves and never after.
    """

    @property
    def session_id(self) -> str:
        """The name peers use to address this engine."""
        ...

    def probe(self, peer: str) -> bool:
        """True if `peer` answers. May block as long as the peer does not answer, but must
        not block other calls meanwhile (the lanes call it on a helper thread)."""
        ...

    def register_memory(self, addr: int, length: int) -> None: ...

    def unregister_memory(self, addr: int) -> None: ...

    def submit_write(self, peer: str, transfers: Sequence[Transfer]) -> object: ...

    def poll(self, handle: object) -> BatchState: ...
