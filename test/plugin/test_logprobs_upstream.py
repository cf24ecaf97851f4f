"""Lynx's rebuilt logprobs (``lynx.verify.committed_logprobs``) against upstream's own
computation for a decoded token (``Sampler.forward``: ``log_softmax(logits / T)``, then
``OutputLogprobProcessor.compute_logprobs``), on the same logits."""

from __future__ import annotations

import pytest
import torch

from lynx.verify import LogprobRequest, committed_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rebuilt_logprobs_equal_upstreams(temperature: float) -> None:
    # Imported here, not at collection: SGLang imports Triton, which must not be loaded
    # before test/unit/test_codec_triton.py turns its interpreter on.
    from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

    torch.manual_seed(1)
    logits = torch.randn(5, 50) * 4
    tokens = [3, 17, 17, 0, 49]
    asked = LogprobRequest(top_n=4, token_ids=(2, 9, 49), temperature=temperature)
    ours = committed_logprobs(logits, tokens, asked)
    theirs = OutputLogprobProcessor().compute_logprobs(
        torch.log_softmax(logits / temperature, dim=-1),
        [asked.top_n] * len(tokens),
        [list(asked.token_ids or ())] * len(tokens),
        torch.tensor(tokens),
    )
    assert ours.token_val == theirs.token_logprobs.tolist()
    assert ours.top_val == [row.tolist() for row in theirs.top_logprobs_val]
    assert ours.top_idx == [row.tolist() for row in theirs.top_logprobs_idx]
    assert ours.ids_val == [row.tolist() for row in theirs.token_ids_logprobs_val]
    assert ours.ids_idx == theirs.token_ids_logprobs_idx
