"""Keep the distribution each held token of a sampled request was drawn from
(``--lynx-mode speculative``): the speculative-sampling rule compares it with the
full-precision one when the Residual lands.

Hook target (``sglang.srt.`` omitted):
* ``model_executor.model_runner.ModelRunner.sample`` AROUND: before upstream samples a
  decode batch, for each row of a sampled request decoding on Anchor KV, keep the
  probabilities upstream's sampler filters and draws from (:func:`lynx.verify.
  tempered_probs`: temperature, softmax); the filters (top-k / top-p / min-p) are applied
  once the drawn token is known (:func:`lynx.verify.draft_probs`). Upstream then
  softmaxes the logits in place, so this runs first.

Contract: scheduler thread (the model runner runs there with either scheduler loop);
reads the logits, never changes them.
"""

from __future__ import annotations

from typing import Any

from lynx.verify import tempered_probs
from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

TARGET = "model_executor.model_runner.ModelRunner.sample"


def _keep_draft_distributions(
    original: Any, runner: Any, logits_output: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    decoder = runtime.speculative_decoder()
    sampled = decoder.speculations.sampled_rows() if decoder is not None else {}
    if sampled:
        logits = upstream.next_token_logits(logits_output)
        rows = upstream.decode_forward_rows(forward_batch, logits.shape[0]) or []
        for i, pool_row in enumerate(rows):
            spec = sampled.get(pool_row)
            if spec is not None:
                spec.pending_probs.append(tempered_probs(logits[i : i + 1], spec.sampling)[0])
    return original(runner, logits_output, forward_batch, *args, **kwargs)


def register() -> None:
    hook(TARGET, _keep_draft_distributions, "around")
