"""One request's speculation (:class:`Speculation`) and the decoder's book of them
(:class:`Speculations`): kept by the request's room (``bootstrap_room``, unique among the
live requests of a decode server: its receiver refuses a second request for a room in use)
and looked up for the very request object that holds it, so two live requests that share
a client's request id never see each other's state. The book answers what the engine's
hooks ask of a request (is it speculating, does it hold tokens, may it stream) and ends a
speculation: its receive space is given back once prefill no longer writes into it.
Scheduler thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lynx.metrics import LynxMetrics
from lynx.speculative.engine import DecodeEngine, LayerRows
from lynx.transfer import ProgressiveReceiver, RoomReport
from lynx.verdict import Verdict
from lynx.verify import (
    HeldTokens,
    SamplingSettings,
    SpecState,
    SpeculationReport,
    SpeculationStats,
    WindowEstimator,
)

META_INFO_KEY = "lynx_transfer"  # the response's meta info that carries Lynx's report
_HOLDING = (SpecState.SPECULATIVE, SpecState.PARKED, SpecState.VERIFYING)


@dataclass
class Speculation:
    """Lynx's state of one request in speculative mode, from admission to its end."""

    req: Any  # the engine's request, decoding on the Anchor, parked or waiting for its Residual
    room: int
    slots: torch.Tensor  # the prompt's KV slots, where the receiver writes
    prompt_len: int
    held: HeldTokens
    sampling: SamplingSettings
    admitted_at: float
    last_held_at: float | None = None
    transfer: RoomReport | None = None
    report: SpeculationReport | None = None
    # Sampled requests: the unfiltered probabilities tokens in flight are drawn from
    # (:func:`lynx.verify.tempered_probs`), oldest first (appended by the sampler hook,
    # filtered around the drawn token when it is held). The overlap loop
    # samples a step before the previous step's token is held: two may be in flight.
    pending_probs: deque[torch.Tensor] = field(default_factory=deque)
    draft_bytes: int = 0  # what its held draft distributions take
    refine_s: float = 0.0  # how long refining its KV took so far
    refined: bool = False  # every layer of its prompt KV is at full precision
    # Parked, with ``--lynx-verify-pass layers``: its held rows, run through each layer as
    # it is refined (``SpeculativeDecoder._verify_ahead``), and the time that took
    layerwise: LayerRows | None = None
    verify_ahead_s: float = 0.0
    layers_ahead: int = 0  # the layers its rows had gone through when its Residual landed
    # The engine's reasoning-token count after t_0 (DecodeEngine.reasoning_state): a
    # commit restores it and counts the committed tokens again.
    reasoning: tuple[Any, ...] = ()
    # Parked and taken out of every batch: it holds its KV outside the engine's batches.
    out_of_batch: bool = False

    @property
    def sampled(self) -> bool:
        return self.held.draft_probs is not None


class Speculations:
    """See the module docstring. ``overlap``: the engine runs the overlap loop (a step is
    launched before the last one's token is known)."""

    def __init__(
        self,
        engine: DecodeEngine,
        receiver: ProgressiveReceiver,
        stats: SpeculationStats,
        window: WindowEstimator,
        metrics: LynxMetrics | None,
        *,
        overlap: bool,
    ) -> None:
        self._engine = engine
        self._receiver = receiver
        self._stats = stats
        self._window = window
        self._metrics = metrics
        self._overlap = overlap
        self._by_room: dict[int, Speculation] = {}
        self._draining: set[int] = set()  # rooms whose request ended before the Residual landed

    def __bool__(self) -> bool:
        return bool(self._by_room)

    def __iter__(self) -> Iterator[Speculation]:
        return iter(list(self._by_room.values()))

    def add(self, spec: Speculation) -> None:
        # The receiver refuses a second request for a room in use.
        assert spec.room not in self._by_room, f"room {spec.room} speculates for two requests"
        self._by_room[spec.room] = spec
        self._stats.active += 1

    def of(self, req: Any) -> Speculation | None:
        spec = self._by_room.get(self._engine.room(req))  # type: ignore[arg-type]
        return spec if spec is not None and spec.req is req else None

    def get(self, req: Any) -> Speculation:
        spec = self.of(req)
        assert spec is not None, f"request {self._engine.request_id(req)} is not tracked by Lynx"
        return spec

    # ---- what the hooks ask -------------------------------------------------------------------

    def is_speculating(self, req: Any) -> bool:
        """Decoding on Anchor KV right now (its new tokens are held)."""
        spec = self.of(req)
        return spec is not None and spec.held.state is SpecState.SPECULATIVE

    def takes_token(self, req: Any) -> bool:
        """A token ``req`` just decoded is to be held: it decodes on Anchor KV, or (overlap
        loop) it is the late token of a step launched before the request parked."""
        spec = self.of(req)
        if spec is None:
            return False
        if spec.held.state is SpecState.SPECULATIVE:
            return True
        return self._overlap and spec.held.state is SpecState.PARKED and not spec.held.late

    def holds_tokens(self, req: Any) -> bool:
        """Has tokens the client must not see yet."""
        spec = self.of(req)
        return (
            spec is not None
            and spec.held.state in _HOLDING
            and not self._engine.finished(req)
            and len(self._engine.tokens(req)) > 1
        )

    def sampled_rows(self) -> dict[int, Speculation]:
        """Request-pool row -> speculation of a sampled request decoding on the Anchor (its
        draft distributions are kept)."""
        return {
            self._engine.pool_row(spec.req): spec
            for spec in self._by_room.values()
            if spec.sampled and spec.held.state is SpecState.SPECULATIVE
        }

    def parked_requests(self) -> list[Any]:
        return [spec.req for spec in self._by_room.values() if spec.out_of_batch]

    def holds_kv_outside_batches(self) -> bool:
        return any(spec.out_of_batch for spec in self._by_room.values())

    def hold_out_of_batch(self, reqs: Iterable[Any]) -> None:
        """``reqs`` (parked) were taken out of the running batch by the caller."""
        for req in reqs:
            self.get(req).out_of_batch = True

    # ---- the end of a speculation -------------------------------------------------------------

    def end(self, room: int, *, drain: bool) -> None:
        """Forget the room's speculation and its draft distributions; give its receive
        space back, at once or (``drain``: its Residual may still be written) once prefill
        has settled it, learning the link's rate from what its transfer took."""
        spec = self._by_room.pop(room, None)
        if spec is not None:
            self._stats.active -= 1
        if spec is not None and spec.held.draft_probs is not None:
            self._stats.draft_bytes -= spec.draft_bytes
            spec.draft_bytes = 0
            spec.held.draft_probs.clear()
        if drain and self._receiver.residual_verdict(room)[0] is Verdict.WAIT:
            self._draining.add(room)  # prefill still writes into its receive space
            return
        transfer = self._receiver.forget(room)
        if spec is not None:
            spec.transfer = transfer
        if transfer is not None and transfer.residual_latency_s and transfer.anchor_latency_s is not None:
            self._window.observe_residual(
                transfer.residual_bytes,
                transfer.residual_latency_s - transfer.anchor_latency_s,
                transfer.residual_space,
            )
        if transfer is not None and self._metrics is not None:
            self._metrics.observe(transfer)

    def drain(self) -> None:
        """Give back the receive space of ended requests whose Residual settled since."""
        for room in list(self._draining):
            if self._receiver.residual_verdict(room)[0] is not Verdict.WAIT:
                self._draining.discard(room)
                self._receiver.forget(room)

    def report(self, spec: Speculation) -> None:
        """Attach what its transfer and speculation cost to the request's response."""
        info = {} if spec.transfer is None else asdict(spec.transfer)
        if spec.report is not None:
            info["speculation"] = asdict(spec.report)
        self._engine.set_info(spec.req, META_INFO_KEY, info)
