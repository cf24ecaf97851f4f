"""SGLang as a :class:`lynx.speculative.DecodeEngine`: each operation the speculative
decoder needs, over SGLang's request, scheduler and model runner, through
:mod:`lynx_patches.upstream` (where each upstream target the glue relies on is named and
checked). Stateless: the scheduler is passed in by the hooks.

Imported at plugin registration, before SGLang may be imported: ``upstream`` imports
SGLang's names where they are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lynx.speculative import LayerRows, RowStop
from lynx.verify import CommittedLogprobs, SamplingSettings
from lynx_patches import upstream


class SGLangDecodeEngine:
    """See the module docstring and :class:`lynx.speculative.DecodeEngine`."""

    # ---- the request's fields ----------------------------------------------------------------

    def room(self, req: Any) -> int | None:
        return upstream.bootstrap_room(req)

    def tokens(self, req: Any) -> Sequence[int]:
        return upstream.output_ids(req)

    def prompt_len(self, req: Any) -> int:
        return upstream.prompt_len(req)

    def request_id(self, req: Any) -> str:
        return upstream.request_id(req)

    def sampling(self, req: Any, vocab_size: int) -> SamplingSettings:
        return upstream.sampling_settings(req, vocab_size)

    def pool_row(self, req: Any) -> int:
        return upstream.req_pool_row(req)

    def kv_allocated_len(self, req: Any) -> int:
        return upstream.kv_allocated_len(req)

    def finished(self, req: Any) -> bool:
        return upstream.is_finished(req)

    def is_aborting(self, req: Any) -> bool:
        return upstream.is_aborting(req)

    def first_chunk_pending(self, req: Any) -> bool:
        return upstream.first_stream_chunk(req)

    def streamed_every_token(self, req: Any) -> bool:
        return upstream.streamed_every_token(req)

    # ---- its outcome ---------------------------------------------------------------------------

    def reasoning_state(self, req: Any) -> tuple[Any, ...]:
        return upstream.reasoning_state(req)

    def commit_tokens(
        self,
        scheduler: Any,
        req: Any,
        keep: int,
        correction: int | None,
        logprobs: CommittedLogprobs | None,
        reasoning: tuple[Any, ...],
    ) -> None:
        upstream.truncate_output(req, keep)
        if correction is not None:
            upstream.append_output(req, correction)
        if logprobs is not None:
            upstream.replace_output_logprobs(req, 1, logprobs)
        upstream.recount_reasoning(scheduler, req, reasoning, upstream.output_ids(req)[1:])

    def set_kv_len(self, scheduler: Any, req: Any, kept: int, free: tuple[int, int] | None) -> None:
        upstream.set_kv_len(scheduler, req, kept, free)

    def check_finish(self, req: Any, new_tokens: int) -> None:
        upstream.update_finish_state(req, new_tokens)

    def abort_with(self, req: Any, reason: str) -> None:
        upstream.abort_with(req, reason)

    def set_info(self, req: Any, key: str, info: dict[str, Any]) -> None:
        upstream.set_request_info(req, key, info)

    # ---- batches ----------------------------------------------------------------------------

    def remove_from_batches(self, scheduler: Any, reqs: Sequence[Any]) -> None:
        upstream.remove_from_batches(scheduler, reqs)

    def requeue(self, scheduler: Any, req: Any) -> None:
        upstream.requeue(scheduler, req)

    def release_and_answer(self, scheduler: Any, req: Any) -> None:
        upstream.release_and_answer(scheduler, req)

    def stream_now(self, scheduler: Any, req: Any) -> None:
        upstream.stream_now(scheduler, req)

    def process_in_flight_batch(self, scheduler: Any) -> None:
        upstream.process_in_flight_batch(scheduler)

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
        return upstream.run_verify_forward(scheduler, reqs, prompt_lens, in_steps=in_steps, stop=stop)

    def layerwise_unsupported(self, scheduler: Any) -> str | None:
        return upstream.layerwise_unsupported(scheduler)

    def new_layer_rows(self) -> LayerRows:
        return upstream.LayerwiseRows()

    def advance_layerwise(
        self, scheduler: Any, req: Any, prompt_len: int, rows: LayerRows, layers: int
    ) -> None:
        assert isinstance(rows, upstream.LayerwiseRows)
        upstream.advance_layerwise(scheduler, req, prompt_len, rows, layers)

    def layerwise_logits(self, scheduler: Any, rows: LayerRows) -> torch.Tensor:
        assert isinstance(rows, upstream.LayerwiseRows)
        return upstream.layerwise_logits(scheduler, rows)
