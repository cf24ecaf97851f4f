"""What speculative decoding asks of the serving engine it runs in: :class:`DecodeEngine`.

The decoder (:mod:`lynx.speculative.decoder`) holds the policy: which tokens to hold, when
to park, verify, accept, commit, roll back. Everything it reads or does to the engine's
requests, batches and forward passes goes through these operations, implemented once
for SGLang (``lynx_patches.decode_engine.SGLangDecodeEngine``, over
``lynx_patches.upstream``) and by a small fake in the decoder's unit tests.

A request (``req``) and the scheduler (``scheduler``) are the engine's own objects,
opaque here. Every operation runs on the scheduler thread. The operations, by group:

* the request's fields (11): its room, tokens, prompt length, id, sampling, pool row,
  KV length, whether it finished or is aborting, how much of it streamed;
* its outcome (6): commit its tokens, set its KV length, re-run the finish check, abort
  it with a reason, attach Lynx's report, restore its reasoning count;
* batches (5): take requests out of them, requeue one, release and answer a finished
  one, stream one's output now, process the step in flight (overlap loop);
* the verify forward (5): the batched or stepped pass, and the layer-by-layer pass
  (whether the server supports it, new rows, advance them, their logits).

Why so many: each is one thing the decoder must read or do and SGLang keeps in a
different place (the request, its KV pool, the scheduler's queues, the model runner);
grouping them further would hide which upstream state a decision touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from lynx.verify import CommittedLogprobs, SamplingSettings

# stop(n, i, row): row i of request n of a stepped verify pass rejects: its later rows
# need not be computed.
RowStop = Callable[[int, int, torch.Tensor], bool]


class LayerRows(Protocol):
    """One request's held rows in the layer-by-layer verify pass, run through the first
    ``layers`` layers so far."""

    layers: int


class DecodeEngine(Protocol):
    """See the module docstring."""

    # ---- the request's fields ----------------------------------------------------------------

    def room(self, req: Any) -> int | None:
        """The room of the request's PD transfer (None outside PD)."""

    def tokens(self, req: Any) -> Sequence[int]:
        """Its output tokens: ``t_0`` from prefill, then those decoded (held ones included)."""

    def prompt_len(self, req: Any) -> int: ...

    def request_id(self, req: Any) -> str: ...

    def sampling(self, req: Any, vocab_size: int) -> SamplingSettings: ...

    def pool_row(self, req: Any) -> int:
        """Its row in the request pool (the sampler's batch rows map to it)."""

    def kv_allocated_len(self, req: Any) -> int: ...

    def finished(self, req: Any) -> bool: ...

    def is_aborting(self, req: Any) -> bool:
        """An abort (client or server) is pending on it."""

    def first_chunk_pending(self, req: Any) -> bool:
        """No token of it has been streamed yet."""

    def streamed_every_token(self, req: Any) -> bool:
        """Not finished, and its next streamed chunk would carry no token."""

    # ---- its outcome ---------------------------------------------------------------------------

    def reasoning_state(self, req: Any) -> tuple[Any, ...]:
        """Its reasoning-token count, to restore at a commit."""

    def commit_tokens(
        self,
        scheduler: Any,
        req: Any,
        keep: int,
        correction: int | None,
        logprobs: CommittedLogprobs | None,
        reasoning: tuple[Any, ...],
    ) -> None:
        """Keep its first ``keep`` output tokens and append ``correction``; with
        ``logprobs``, keep ``t_0``'s logprobs and append those; restore the reasoning count
        to ``reasoning`` and count the kept tokens after ``t_0`` again."""

    def set_kv_len(self, scheduler: Any, req: Any, kept: int, free: tuple[int, int] | None) -> None:
        """Its KV now ends at ``kept`` tokens; ``free`` ([start, end)) goes back to the pool."""

    def check_finish(self, req: Any, new_tokens: int) -> None:
        """The engine's finish check (EOS, stop strings, lengths, a pending abort) over its
        last ``new_tokens`` tokens."""

    def abort_with(self, req: Any, reason: str) -> None:
        """Finish it at its next finish check with ``reason`` (a server error)."""

    def set_info(self, req: Any, key: str, info: dict[str, Any]) -> None:
        """Put ``info`` into its response's meta info under ``key``."""

    # ---- batches ----------------------------------------------------------------------------

    def remove_from_batches(self, scheduler: Any, reqs: Sequence[Any]) -> None:
        """Out of the running batch and the waiting queue (they keep their KV)."""

    def requeue(self, scheduler: Any, req: Any) -> None:
        """Back through the waiting queue: re-admitted with its committed tokens."""

    def release_and_answer(self, scheduler: Any, req: Any) -> None:
        """A finished request: free its KV and answer the client."""

    def stream_now(self, scheduler: Any, req: Any) -> None:
        """Stream what it has not streamed yet, now."""

    def process_in_flight_batch(self, scheduler: Any) -> None:
        """Overlap loop: process the step launched last iteration now (no-op otherwise)."""

    # ---- the verify forward -----------------------------------------------------------------

    def run_verify_forward(
        self,
        scheduler: Any,
        reqs: Sequence[Any],
        prompt_lens: Sequence[int],
        *,
        in_steps: bool,
        stop: RowStop,
    ) -> list[torch.Tensor]:
        """Each request's verify logits ((k, vocab) float32, k its held tokens, fewer where
        ``stop`` ended its rows in steps): with ``in_steps`` row i of every request in
        decode step i, bit for bit what decoding computes; else one batched forward."""

    def layerwise_unsupported(self, scheduler: Any) -> str | None:
        """Why this server cannot run held rows layer by layer; None if it can."""

    def new_layer_rows(self) -> LayerRows: ...

    def advance_layerwise(
        self, scheduler: Any, req: Any, prompt_len: int, rows: LayerRows, layers: int
    ) -> None:
        """Bring ``rows`` up to its held tokens, then run every row through the first
        ``layers`` layers (whose prompt KV is refined)."""

    def layerwise_logits(self, scheduler: Any, rows: LayerRows) -> torch.Tensor:
        """The logits of ``rows``, run through every layer."""
