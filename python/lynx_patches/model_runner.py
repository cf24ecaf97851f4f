"""Keep the distribution each held token of a sampled request was drawn from
(``--lynx-mode speculative``): the speculative-sampling rule compares it with the
full-precision one when the Residual lands.

Hook target (``sglang.srt.`` omitted):
* ``model_executor.model_runner.ModelRunner.sample`` AROUND: before upstream samples a
  decode batch, for each row of a sampled request decoding on Anchor KV, keep
  ``softmax(logits / temperature)`` -- the distribution upstream's sampler draws from
  for the settings Lynx speculates on (temperature only; the others wait for the
  Residual). Upstream then softmaxes the logits in place, so this runs first.
"""

from __future__ import annotations

from typing import Any

import torch

from lynx_patches import lynx_speculation
from lynx_patches._hooks import hook

TARGET = "model_executor.model_runner.ModelRunner.sample"


def _keep_draft_distributions(
    original: Any, runner: Any, logits_output: Any, forward_batch: Any, *args: Any, **kwargs: Any
) -> Any:
    decoder = lynx_speculation.current()
    rows = decoder.sampled_rows() if decoder is not None else {}
    if rows and forward_batch.forward_mode.is_decode():
        logits = logits_output.next_token_logits
        for i, pool_row in enumerate(forward_batch.req_pool_indices[: logits.shape[0]].tolist()):
            req = rows.get(pool_row)
            if req is not None:
                spec = lynx_speculation.speculation_of(req)
                assert spec is not None
                temperature = float(req.sampling_params.temperature)
                spec.pending_probs = torch.softmax(logits[i].float() / temperature, dim=-1)
    return original(runner, logits_output, forward_batch, *args, **kwargs)


def register() -> None:
    hook(TARGET, _keep_draft_distributions, "around")
