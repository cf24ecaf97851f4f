"""KV bookkeeping of a commit: which of a request's KV slots outlive verification.

Before verification a request with prompt length ``P`` holds KV for ``P`` prompt tokens
plus every output token fed so far (``allocated`` slots in all). Committing ``m``
accepted held tokens keeps the KV of the prompt, of the exact first token ``t_0`` and of
``t_1..t_m``: ``P + m + 1`` tokens, which the verify pass rewrote on refined KV. The
correction (or bonus) token has no KV yet: the next decode step writes it. Slots from the
next page boundary on go back to the pool; a partly used last page stays with the
request (the next decode step continues in it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCommit:
    kept: int  # committed = allocated length after the commit
    free: tuple[int, int] | None  # [start, end) token positions to free, page aligned at start


def kv_after_commit(prompt_len: int, accepted: int, allocated: int, page_size: int) -> KVCommit:
    if prompt_len < 1 or accepted < 0 or page_size < 1:
        raise ValueError(f"bad commit: prompt_len={prompt_len} accepted={accepted} page_size={page_size}")
    kept = prompt_len + accepted + 1
    if kept > allocated:
        raise ValueError(f"committing {kept} tokens of KV, only {allocated} are allocated")
    start = -(-kept // page_size) * page_size
    return KVCommit(kept=kept, free=(start, allocated) if start < allocated else None)
