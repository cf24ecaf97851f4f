"""KV bookkeeping of a commit: which of a request's KV slots outlive verification.

A decode request with prompt length ``P`` and ``n`` output tokens has KV for ``P + n - 1``
tokens: the last output token is the next step's input and has none yet. Before
verification a speculative request holds ``allocated`` slots (``P`` plus every output
token fed so far). After a commit leaves it ``n`` output tokens (``t_0``, the accepted
held tokens, maybe the correction), it keeps the KV of the first ``P + n - 1`` tokens,
which the verify pass rewrote on refined KV. Slots from the next page boundary on go
back to the pool; a partly used last page stays with the request (the next decode step
continues in it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCommit:
    kept: int  # committed = allocated length after the commit
    free: tuple[int, int] | None  # [start, end) token positions to free, page aligned at start


def kv_after_commit(prompt_len: int, output_len: int, allocated: int, page_size: int) -> KVCommit:
    if prompt_len < 1 or output_len < 1 or page_size < 1:
        raise ValueError(f"bad commit: prompt_len={prompt_len} output_len={output_len} page_size={page_size}")
    kept = prompt_len + output_len - 1
    if kept > allocated:
        raise ValueError(f"committing {kept} tokens of KV, only {allocated} are allocated")
    start = -(-kept // page_size) * page_size
    return KVCommit(kept=kept, free=(start, allocated) if start < allocated else None)
