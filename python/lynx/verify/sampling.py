"""The distribution a sampled request's token is drawn from, rebuilt from logits, so the
speculative-sampling rule compares like with like.

Both the draft distribution ``q`` (kept when a token is sampled on Anchor KV) and the
verify distribution ``p`` (from the verify pass on refined KV) go through the same
:func:`target_probs`: temperature, softmax, then top-k, top-p and min-p filtering as
upstream's torch sampling backend applies them (``sglang.srt.layers.sampler.
top_k_top_p_min_p_sampling_from_probs_torch``, whose draws are ``multinomial`` over the
filtered, unnormalised probabilities). The rule then commits tokens distributed exactly as
the filtered full-precision distribution, as upstream's own speculative decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynx.verify.logprobs import LogprobRequest


@dataclass(frozen=True)
class SamplingSettings:
    """What decides one request's token choice, as far as verification is concerned."""

    temperature: float
    top_k: int  # 1 means greedy (the serving engine's normalisation of temperature 0)
    top_p: float
    min_p: float
    vocab_size: int
    # What it asked to get back per output token (rebuilt from the verify pass), if anything.
    logprobs: LogprobRequest | None = None
    # Per-token features the verify pass cannot reproduce exactly (yet), by name.
    grammar: bool = False
    penalties: bool = False
    min_new_tokens: bool = False
    logit_bias: bool = False
    custom_logit_processor: bool = False
    hidden_states: bool = False
    watermark: bool = False
    # Per-token outputs upstream appends as it decodes (sampling masks, routed experts,
    # indexer top-k): held tokens would carry the Anchor pass's, rejected ones too.
    per_token_outputs: bool = False

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """``probs`` (rows, vocab) with what top-k, top-p and min-p exclude set to 0 (not
    renormalised). Ties at a cut-off fall as a descending sort orders them."""
    vocab = probs.shape[-1]
    if top_k >= vocab and top_p >= 1.0 and min_p <= 0.0:
        return probs
    ordered, index = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered  # mass of the tokens ranked above each
    ordered[..., torch.arange(vocab, device=probs.device) >= top_k] = 0.0
    ordered[before > top_p] = 0.0
    if min_p > 0.0:
        ordered[ordered < ordered[..., :1] * min_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, index, ordered)


def target_probs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """(rows, vocab) float32: what a sampled request draws each token from, given its
    logits rows."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    return filter_probs(probs, sampling.top_k, sampling.top_p, sampling.min_p)
