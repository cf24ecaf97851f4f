"""Lynx on a second real model family: Qwen2.5-Coder-0.5B-Instruct (trained weights in
BF16, 24 layers, 2 KV heads of 64, keys with strong outlier channels), built from the
package index by ``lynx.tools.models``.

Speculative mode with the exact Residual must return what plain BF16 PD returns, token for
token: the Residual is held back so every request decodes on its 4-bit Anchor first and
is verified. Requests run one at a time, as the reference does, so both sides decode at
the same batch sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdtools import Prefill, decode_server, pd_generate, state

from lynx.tools import models
from lynx.tools.cluster import ServerConfig, running

pytestmark = pytest.mark.e2e

COMMON = ["--chunked-prefill-size", "256", "--disable-radix-cache"]
SPEC_EXACT = [
    "--lynx",
    "--lynx-mode",
    "speculative",
    "--lynx-residual",
    "exact",
    "--lynx-residual-hold",
    "1.5",
    "--lynx-transfer-deadline",
    "30",
]
PROMPTS = [
    "<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome."
    "<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(items):\n    ",
]


@pytest.fixture(scope="module")
def servers(log_dir: Path) -> Iterator[dict[str, Any]]:
    config = ServerConfig(model_path=models.prepare_qwen25_coder(), max_total_tokens=4096, extra_args=COMMON)
    group: dict[str, Any] = {
        "P0": Prefill(config, log_dir, "P0", []),
        "D0": decode_server(config, log_dir, "D0", []),
        "PS": Prefill(config, log_dir, "PS", SPEC_EXACT),
        "DS": decode_server(config, log_dir, "DS", [*SPEC_EXACT, "--disable-overlap-schedule"]),
    }
    with running(group):
        yield group


def test_speculative_with_exact_residual_equals_plain_bf16_pd_on_qwen(servers: dict) -> None:
    held = 0
    for prompt in PROMPTS:
        plain = pd_generate(servers["P0"], servers["D0"], prompt, max_new_tokens=16)
        lynx = pd_generate(servers["PS"], servers["DS"], prompt, max_new_tokens=16)
        assert lynx["output_ids"] == plain["output_ids"], prompt
        held += lynx["meta_info"]["lynx_transfer"][0]["speculation"]["held"]
    assert held > 0  # the requests really decoded on the Anchor and were verified
    stats = state(servers["DS"])["lynx_transfer"]["speculation"]
    print(f"Qwen2.5-Coder, 4-bit Anchors: {stats}")
