"""Which KV positions a commit keeps and frees."""

from __future__ import annotations

import pytest

from lynx.verify.rollback import KVCommit, kv_after_commit


@pytest.mark.parametrize(
    ("prompt", "output_len", "allocated", "page", "expected"),
    [
        (100, 5, 108, 1, KVCommit(104, (104, 108))),  # t0 + 3 accepted + correction: free 4
        (100, 9, 108, 1, KVCommit(108, None)),  # all 8 held accepted: nothing to free
        (100, 2, 108, 16, KVCommit(101, None)),  # the rejected slots share the kept page
        (100, 2, 130, 16, KVCommit(101, (112, 130))),  # later pages go, the partial one stays
        (96, 17, 128, 16, KVCommit(112, (112, 128))),  # kept ends on a page boundary
        (100, 1, 100, 1, KVCommit(100, None)),  # nothing held
    ],
)
def test_commit(prompt: int, output_len: int, allocated: int, page: int, expected: KVCommit) -> None:
    assert kv_after_commit(prompt, output_len, allocated, page) == expected


def test_bad_commits_raise() -> None:
    with pytest.raises(ValueError, match="only 104 are allocated"):
        kv_after_commit(100, 6, 104, 1)
    with pytest.raises(ValueError, match="bad commit"):
        kv_after_commit(0, 1, 4, 1)
    with pytest.raises(ValueError, match="bad commit"):
        kv_after_commit(10, 0, 14, 1)
