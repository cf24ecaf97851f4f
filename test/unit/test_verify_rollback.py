"""Which KV positions a commit keeps and frees."""

from __future__ import annotations

import pytest

from lynx.verify.rollback import KVCommit, kv_after_commit


@pytest.mark.parametrize(
    ("prompt", "accepted", "allocated", "page", "expected"),
    [
        (100, 3, 108, 1, KVCommit(104, (104, 108))),  # 7 held fed, 3 accepted: free the other 4
        (100, 7, 108, 1, KVCommit(108, None)),  # all accepted: nothing to free
        (100, 0, 108, 16, KVCommit(101, None)),  # the rejected slots share the kept page
        (100, 0, 130, 16, KVCommit(101, (112, 130))),  # later pages go, the partial one stays
        (96, 15, 128, 16, KVCommit(112, (112, 128))),  # kept ends on a page boundary
    ],
)
def test_commit(prompt: int, accepted: int, allocated: int, page: int, expected: KVCommit) -> None:
    assert kv_after_commit(prompt, accepted, allocated, page) == expected


def test_bad_commits_raise() -> None:
    with pytest.raises(ValueError, match="only 104 are allocated"):
        kv_after_commit(100, 4, 104, 1)
    with pytest.raises(ValueError, match="bad commit"):
        kv_after_commit(0, 0, 4, 1)
