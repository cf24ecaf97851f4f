"""The log-probabilities a request asked for, rebuilt for its committed tokens from the
verify pass, so a speculating request returns what full-precision decoding would have.

While a request speculates, upstream appends each held token's logprobs from the Anchor
pass. The verify pass has the full-precision logits of every held position, so after the
commit each committed token's entries are recomputed from them, the way upstream's
sampler computes them for a decoded token (``sglang.srt.layers.sampler.Sampler.forward``
with ``logprob_processor.OutputLogprobProcessor``): ``log_softmax(logits / temperature)``
with the request's temperature (1 for greedy requests, and for every request under
``SGLANG_RETURN_ORIGINAL_LOGPROB``), before any top-k / top-p / min-p filtering; the
``top_n`` best as ``topk`` orders them; the values at the requested token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LogprobRequest:
    """What a request asked to get back for each output token."""

    top_n: int = 0  # the best ``top_n`` (value, token id) pairs per position
    token_ids: tuple[int, ...] | None = None  # and the values at these token ids
    temperature: float = 1.0  # the logits are divided by it first


@dataclass
class CommittedLogprobs:
    """Per committed token, in order: the entries upstream keeps per output token.
    ``top_*`` are filled only when ``top_n`` > 0, ``ids_*`` only when token ids were
    asked for (as upstream fills them)."""

    token_val: list[float] = field(default_factory=list)
    token_idx: list[int] = field(default_factory=list)
    top_val: list[list[float]] = field(default_factory=list)
    top_idx: list[list[int]] = field(default_factory=list)
    ids_val: list[list[float]] = field(default_factory=list)
    ids_idx: list[list[int]] = field(default_factory=list)


def committed_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], asked: LogprobRequest
) -> CommittedLogprobs:
    """The entries of ``tokens`` (the committed tokens after ``t_0``), where row i of
    ``logits`` (the verify pass's rows, at least ``len(tokens)``) predicts ``tokens[i]``."""
    n = len(tokens)
    if logits.dim() != 2 or logits.shape[0] < n:
        raise ValueError(f"{tuple(logits.shape)} verify logits for {n} committed tokens")
    if not asked.temperature > 0:
        raise ValueError(f"logprobs need a positive temperature, got {asked.temperature}")
    vocab = logits.shape[1]
    outside = [t for t in (*tokens, *(asked.token_ids or ())) if not 0 <= t < vocab]
    if outside:  # an IndexError would escape the caller's per-request handling
        raise ValueError(f"token id {outside[0]} is outside the vocabulary of {vocab}")
    out = CommittedLogprobs()
    if n == 0:
        return out
    logprobs = torch.log_softmax(logits[:n].float() / asked.temperature, dim=-1)
    logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)  # no -inf, as upstream returns them
    index = torch.tensor(list(tokens), dtype=torch.int64)
    out.token_val = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    out.token_idx = [int(t) for t in tokens]
    if asked.top_n > 0:
        values, ids = logprobs.topk(min(asked.top_n, logprobs.shape[1]), dim=-1)
        out.top_val, out.top_idx = values.tolist(), ids.tolist()
    if asked.token_ids is not None:
        ids_list = list(asked.token_ids)
        out.ids_val = logprobs[:, ids_list].tolist()
        out.ids_idx = [ids_list for _ in range(n)]
    return out
