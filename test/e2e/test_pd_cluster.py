"""A real prefill + decode + router on the CPU, against single servers on the same model.

Servers in this module: the PD cluster (``--lynx-mode speculative`` with the exact
residual, arriving late: decode starts on 2-bit Anchors and verifies), a single server
with the plugin loaded but no ``--lynx``, and a single server with the plugin not loaded
at all (``SGLANG_PLUGINS`` names no plugin; only the ``sgl_kernel`` stand-in is on the
path, without which upstream cannot start on the CPU). Through the router, with OpenAI
streaming, the client must see exactly what the single server answers.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from lynx.tools.cluster import PDCluster, ServerConfig, SingleServer, http_json, running
from lynx.tools.demo import chat_once
from lynx_patches.sgl_kernel import SHIM_ROOT

pytestmark = pytest.mark.e2e

# Small chunks make prefill send several chunks per request, as long prompts do.
CHUNK = ["--chunked-prefill-size", "128"]
# The exact residual: Lynx must then answer exactly what plain BF16 serving does.
LYNX = [
    "--lynx",
    "--lynx-mode",
    "speculative",
    "--lynx-anchor-bits",
    "2",
    "--lynx-group-size",
    "64",
    "--lynx-residual",
    "exact",
    "--lynx-residual-hold",
    "1",
]
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time " * 30,  # ~500 tokens: four prefill chunks
    "KV cache transfer between prefill and decode servers",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def servers(tiny_model: Path, log_dir: Path) -> Iterator[dict]:
    config = ServerConfig(model_path=tiny_model, max_total_tokens=8192, extra_args=CHUNK)
    group = {
        "pd": PDCluster(
            config, log_dir, prefill_args=LYNX, decode_args=[*LYNX, "--disable-overlap-schedule"]
        ),
        "plugin": SingleServer(config, log_dir, name="single-plugin"),
        "upstream": SingleServer(
            config,
            log_dir,
            name="single-upstream",
            env={"SGLANG_PLUGINS": "no-such-plugin", "PYTHONPATH": str(SHIM_ROOT)},
        ),
    }
    with running(group):
        yield group


def generate(url: str, prompt: str, max_new_tokens: int = 24) -> dict:
    return http_json(
        url + "/generate",
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        },
    )


def test_completions_through_router(servers: dict) -> None:
    client = OpenAI(base_url=servers["pd"].url + "/v1", api_key="unused")
    single = OpenAI(base_url=servers["plugin"].url + "/v1", api_key="unused")
    for prompt in ("Hello there", PROMPTS[3]):
        result = client.completions.create(model="default", prompt=prompt, max_tokens=20, temperature=0)
        assert result.usage.completion_tokens == 20
        assert result.choices[0].finish_reason == "length"
        expected = single.completions.create(model="default", prompt=prompt, max_tokens=20, temperature=0)
        assert result.choices[0].text == expected.choices[0].text
        streamed = client.completions.create(
            model="default", prompt=prompt, max_tokens=20, temperature=0, stream=True
        )
        # Held tokens are never streamed, so the pieces add up to the exact answer.
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        assert text == expected.choices[0].text


def test_chat_completions_through_router(servers: dict) -> None:
    client = OpenAI(base_url=servers["pd"].url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something."}]
    result = client.chat.completions.create(model="default", messages=messages, max_tokens=10, temperature=0)
    assert result.usage.completion_tokens == 10
    streamed = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in streamed:
        usage = chunk.usage or usage
        parts.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(parts) == result.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10


def test_demo_chat_helper_measures_ttft(servers: dict) -> None:
    result = chat_once(servers["pd"].url, "Tell me a story.", max_tokens=8)
    assert result.completion_tokens == 8 and result.answer
    assert 0 < result.ttft_s <= result.total_s


def test_lynx_pd_greedy_output_equals_single_server(servers: dict) -> None:
    for prompt in PROMPTS:
        pd = generate(servers["pd"].url, prompt)
        single = generate(servers["plugin"].url, prompt)
        assert pd["output_ids"] == single["output_ids"], prompt[:40]
        assert len(pd["output_ids"]) == 24
        report = pd["meta_info"]["lynx_transfer"][0]  # the KV really came through Lynx
        assert report["anchor_bytes"] > 0 and report["residual_bytes"] > 0
        assert report["speculation"]["held"] > 0  # and decoding started on the Anchor


def test_server_without_lynx_behaves_like_upstream(servers: dict) -> None:
    for prompt in PROMPTS:
        assert (
            generate(servers["plugin"].url, prompt)["output_ids"]
            == generate(servers["upstream"].url, prompt)["output_ids"]
        )
    plugin_info = http_json(servers["plugin"].url + "/server_info")
    upstream_info = http_json(servers["upstream"].url + "/server_info")
    assert plugin_info["internal_states"][0]["lynx"] is None
    assert "lynx" not in upstream_info["internal_states"][0]
    ignore = {"port", "random_seed", "launch_command"}
    assert {k: v for k, v in plugin_info.items() if k not in ignore and not isinstance(v, (dict, list))} == {
        k: v for k, v in upstream_info.items() if k not in ignore and not isinstance(v, (dict, list))
    }


def test_lynx_settings_reach_both_schedulers(servers: dict) -> None:
    for url in (servers["pd"].prefill_url, servers["pd"].decode_url):
        with urllib.request.urlopen(url + "/server_info", timeout=30) as response:
            state = json.loads(response.read())["internal_states"][0]
        assert state["lynx"]["anchor_bits"] == 2
        assert state["lynx"]["mode"] == "speculative"
        assert state["lynx"]["group_size"] == 64
