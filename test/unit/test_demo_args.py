"""The demo gives the decode server what ``--lynx-mode speculative`` needs."""

from __future__ import annotations

import pytest

from lynx.tools.demo import lynx_mode


@pytest.mark.parametrize(
    ("args", "mode"),
    [
        ([], None),
        (["--lynx"], "full"),
        (["--lynx", "--lynx-mode", "speculative"], "speculative"),
        (["--lynx", "--lynx-mode=anchor-only", "--lynx-anchor-bits", "2"], "anchor-only"),
        (["--lynx-mode", "speculative"], None),  # refused by the server: no --lynx
    ],
)
def test_lynx_mode(args: list[str], mode: str | None) -> None:
    assert lynx_mode(args) == mode
