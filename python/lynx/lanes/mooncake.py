"""`TransferBackend` over the Mooncake Transfer Engine (TCP, P2P handshake).

Facts about the engine's Python binding (mooncake-transfer-engine 0.3.13) that shape this
adapter:

- `transfer_check_status(batch_id)` looks only at the *first* entry of a batch, and frees
  the batch once that entry is done. `batch_transfer_async_write` + `transfer_check_status`
  therefore reports a multi-entry batch done while most of it is still in flight (measured:
  "done" after 11 us for 4 x 1 MiB), and `get_batch_transfer_status` spins until the whole
  batch resolves. So every transfer is submitted as its own one-entry batch with
  `transfer_submit_write`, and a lanes batch is a list of those.
- A batch id is the address of the engine's batch descriptor and is reused after it is
  freed: an id that has resolved (1 or -1) must never be polled again.
- Status 1 done, 0 pending, -1 failed (the engine frees the batch), -2 timed out (not
  freed; the async path does not time out in practice). Async status never times out: a
  frozen peer leaves a transfer pending forever, so deadlines are the scheduler's job.
- The first write to a peer opens its segment (a handshake) while holding a mutex that
  every submit takes; to a frozen peer that blocks every submit to every peer. Hence
  `probe` (`send_probe`, which does not take that mutex) before the first write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lynx.lanes.backend import BatchState, Transfer, TransferBackendError

_SUBMIT_REFUSED = (-1, 2**64 - 1)  # batch_id_t is unsigned: the binding's -1 comes back as 2^64-1
_DONE, _PENDING = 1, 0


@dataclass
class _MooncakeBatch:
    ids: list[int]  # one-entry engine batches, in submission order
    resolved: int = 0  # ids[:resolved] have resolved and must not be polled again
    failed: bool = False


class MooncakeBackend:
    """One Mooncake `TransferEngine` per process, reachable at `host:rpc_port`.

    `host` is the address the engine binds its handshake and data listeners to and the one
    peers dial; use the address of the interface the peers reach (127.0.0.1 on loopback,
    the veth address inside a network namespace).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        try:
            from mooncake.engine import TransferEngine  # optional: imported on use
        except ImportError as e:
            raise TransferBackendError(
                "MooncakeBackend needs the Mooncake Transfer Engine: pip install "
                "'sglang-lynx[cpu]' (TCP build) and Debian's libibverbs1, libnl-3-200, "
                f"libnl-route-3-200 ({e})"
            ) from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferBackendError(f"TransferEngine.initialize({host!r}) returned {rc}")
        self._session_id = f"{host}:{self._engine.get_rpc_port()}"

    @classmethod
    def attach(cls, engine: object, session_id: str) -> MooncakeBackend:
        """Drive an engine someone else initialised (SGLang's, whose session id peers
        already know), instead of starting a second one."""
        backend = cls.__new__(cls)
        backend._engine = engine
        backend._session_id = session_id
        return backend

    @property
    def session_id(self) -> str:
        return self._session_id

    def probe(self, peer: str) -> bool:
        # send_probe is a handshake-port RPC outside the binding's segment mutex: a frozen
        # peer blocks only this call (measured: > 40 s, no timeout), a dead one fails fast.
        return self._engine.send_probe(peer) == 0

    def register_memory(self, addr: int, length: int) -> None:
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise TransferBackendError(f"register_memory(0x{addr:x}, {length}) returned {rc}")

    def unregister_memory(self, addr: int) -> None:
        rc = self._engine.unregister_memory(addr)
        if rc != 0:
            raise TransferBackendError(f"unregister_memory(0x{addr:x}) returned {rc}")

    def submit_write(self, peer: str, transfers: Sequence[Transfer]) -> _MooncakeBatch:
        batch = _MooncakeBatch(ids=[])
        for t in transfers:
            batch_id = self._engine.transfer_submit_write(peer, t.src, t.dst, t.length)
            if batch_id in _SUBMIT_REFUSED:
                batch.failed = True
                break
            batch.ids.append(batch_id)
        return batch

    def poll(self, handle: object) -> BatchState:
        assert isinstance(handle, _MooncakeBatch)
        # Parts resolve roughly in submission order (the engine runs a peer's first 4 in
        # parallel, queues the rest), so stopping at the first pending one costs one status
        # call per poll. A failed batch stays PENDING until its other parts resolve, so that
        # the engine frees them and the caller knows nothing of it is still being read.
        while handle.resolved < len(handle.ids):
            status = self._engine.transfer_check_status(handle.ids[handle.resolved])
            if status == _PENDING:
                return BatchState.PENDING
            handle.resolved += 1
            if status != _DONE:
                handle.failed = True
        return BatchState.FAILED if handle.failed else BatchState.DONE
