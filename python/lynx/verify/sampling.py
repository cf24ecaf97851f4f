"""The distribution a sampled request's token is drawn from, rebuilt from logits, so the
speculative-sampling rule compares like with like.

Both the draft distribution ``q`` (kept when a token is sampled on Anchor KV) and the
verify distribution ``p`` (from the verify pass on refined KV) go through the same
:func:`filter_probs` after temperature and softmax: top-k, top-p and min-p filtering as
upstream's torch sampling backend applies them (``sglang.srt.layers.sampler.
top_k_top_p_min_p_sampling_from_probs_torch``, whose draws are ``multinomial`` over the
filtered, unnormalised probabilities). The rule then commits tokens distributed exactly as
the filtered full-precision distribution, as upstream's own speculative decoding does.

Ties at a top-k or top-p cut-off (common: logits from BF16 products take few distinct
values) are kept or cut in an order upstream does not fix: its torch backend takes
``torch.topk`` over the batch's largest top-k, whose order among equal probabilities
differs from a sort's (and may change with that k); flashinfer's kernels have their own.
So ``p`` (:func:`target_probs`) cuts ties as a descending sort orders them, and ``q``
(:func:`draft_probs`) moves the token actually drawn ahead of its equals: it was kept,
whichever order kept it, and with the torch backend its probability, the kept mass and
so the acceptance of every held token are upstream's exactly. Which of the drawn token's
equals were cut with it is unknown; a rejection's correction is drawn as if the sort's
order had cut them.
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


def filter_probs(
    probs: torch.Tensor, top_k: int, top_p: float, min_p: float, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """``probs`` (rows, vocab) with what top-k, top-p and min-p exclude set to 0 (not
    renormalised). Ties at a cut-off fall as a descending sort orders them, but for
    ``keep`` (rows,): each row's token of that index goes first among its equals."""
    vocab = probs.shape[-1]
    if top_k >= vocab and top_p >= 1.0 and min_p <= 0.0:
        return probs
    ordered, index = probs.sort(dim=-1, descending=True, stable=True)
    if keep is not None:
        # Swapping two equal probabilities leaves ``ordered`` as it is: only which token
        # sits at the first place of the value changes.
        rows = torch.arange(probs.shape[0], device=probs.device)
        value = probs[rows, keep]
        first = (probs > value[:, None]).sum(dim=-1)
        at = (index == keep[:, None]).int().argmax(dim=-1)
        index[rows, at] = index[rows, first]
        index[rows, first] = keep
    before = ordered.cumsum(dim=-1) - ordered  # mass of the tokens ranked above each
    ordered[..., torch.arange(vocab, device=probs.device) >= top_k] = 0.0
    ordered[before > top_p] = 0.0
    if min_p > 0.0:
        ordered[ordered < ordered[..., :1] * min_p] = 0.0
    return torch.zeros_like(probs).scatter_(-1, index, ordered)


def tempered_probs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """(rows, vocab) float32: the softmax of ``logits`` rows at the request's temperature,
    before any filter: what upstream's sampler filters and draws from."""
    return torch.softmax(logits.float() / sampling.temperature, dim=-1)


def target_probs(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """(rows, vocab) float32: what a sampled request draws each token from, given its
    logits rows (``p``)."""
    return filter_probs(tempered_probs(logits, sampling), sampling.top_k, sampling.top_p, sampling.min_p)


def draft_probs(tempered: torch.Tensor, sampling: SamplingSettings, token: int) -> torch.Tensor:
    """(vocab,) float32: the distribution ``token`` was drawn from (``q``), given the
    :func:`tempered_probs` row it was drawn from: the filters keep ``token`` wherever it
    ties the cut-off, as upstream's sampler did by drawing it. A token outside the row
    keeps nothing (:func:`lynx.verify.held_tokens_problem` names it before any verify)."""
    inside = 0 <= token < tempered.shape[-1]
    keep = torch.tensor([token], dtype=torch.int64, device=tempered.device) if inside else None
    return filter_probs(tempered[None], sampling.top_k, sampling.top_p, sampling.min_p, keep)[0]
