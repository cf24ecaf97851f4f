"""A real PD cluster behind the router on the CPU, against single servers on the same model.

Servers in this module: the PD cluster, two prefill servers and a decode server behind
``sglang_router`` (``--lynx-mode speculative``, Lynx's defaults otherwise, the Residual
arriving late: decode starts on the Anchor and verifies; the router pairs either prefill with the
decode, which receives from both; one prefill sending to two decode servers is
test_lynx_transfer.py's), a single server
with the plugin loaded but no ``--lynx``, and a single server with the plugin not loaded
at all (``SGLANG_PLUGINS`` names no plugin; only the ``sgl_kernel`` stand-in is on the
path, without which upstream cannot start on the CPU). Through the router, with OpenAI
streaming, the client must see exactly what the single server answers.

And a plain PD cluster (one prefill, one decode, the router; no ``--lynx``): the official
``openai`` client drives both clusters through each feature of the API (the README's
feature table is this module's), and Lynx's answers must equal plain PD's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from pdtools import flush_cache

from lynx.settings import LynxSettings
from lynx.tools.cluster import PDCluster, ServerConfig, SingleServer, http_json, running
from lynx.tools.demo import chat_once
from lynx_patches.sgl_kernel import SHIM_ROOT

pytestmark = pytest.mark.e2e

# Small chunks make prefill send several chunks per request, as long prompts do.
CHUNK = ["--chunked-prefill-size", "128"]
# Lynx's defaults (the exact Residual: Lynx must then answer exactly what plain PD does,
# 4-bit Anchors, decode's overlap scheduler on), in speculative mode, with two settings a
# user would not set, each for a reason: the Residual held back 1 s, so that decode holds
# tokens on the Anchor (on loopback it lands before the first decode step, and no token
# would be held: the tests of what the client sees while tokens are held need it), and a
# deadline short enough for the killed-prefill test to see its requests fail.
LYNX = [
    "--lynx",
    "--lynx-mode",
    "speculative",
    "--lynx-residual-hold",
    "1",
    "--lynx-transfer-deadline",
    "8",
]
# Prefill in turn, decode at random: over a few requests every pair serves. A prefill the
# router finds dead is taken out within seconds (health checks every 2 s).
ROUTER = [
    "--prefill-policy",
    "round_robin",
    "--decode-policy",
    "random",
    "--cb-timeout-duration-secs",
    "5",
    "--health-check-interval-secs",
    "2",
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
    # A decode whose prefill died holds the failed requests' pages for a drain ACK that never
    # comes, until upstream's release timeout (30 s by default): shorter here. So is how long
    # a prefill waits for a decode that refused its request (a duplicate rid: 300 s by
    # default, the router answering the client only then).
    config = ServerConfig(
        model_path=tiny_model,
        max_total_tokens=8192,
        extra_args=CHUNK,
        env={
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "10",
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
        },
    )
    group = {
        "pd": PDCluster(
            config,
            log_dir,
            prefill_args=LYNX,
            decode_args=LYNX,
            router_args=ROUTER,
            prefills=2,
            decodes=1,
        ),
        "plain": PDCluster(config, log_dir / "plain"),
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


@pytest.fixture(scope="module")
def idle_decodes(servers: dict) -> list[int]:
    """Each decode server's free KV tokens with nothing in flight."""
    return [lynx_state(url)["lynx_kv_available_tokens"] for url in servers["pd"].decode_urls]


def lynx_state(url: str) -> dict:
    return http_json(url + "/server_info")["internal_states"][0]


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
    for url in (*servers["pd"].prefill_urls, *servers["pd"].decode_urls):
        with urllib.request.urlopen(url + "/server_info", timeout=30) as response:
            state = json.loads(response.read())["internal_states"][0]
        # the defaults, but the flags LYNX sets
        given = {"mode": "speculative", "residual_hold_s": 1.0, "transfer_deadline_s": 8.0}
        expected = json.loads(LynxSettings(**given).to_json())  # type: ignore[arg-type]
        assert state["lynx"] == expected
        assert state["lynx_codec_backend"] == "cpp"  # compiled at install, loaded at start-up


def test_requests_spread_over_every_pair_answer_exactly(servers: dict, idle_decodes: list[int]) -> None:
    cluster = servers["pd"]
    expected = {prompt: generate(servers["plugin"].url, prompt)["output_ids"] for prompt in PROMPTS}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: (p, generate(cluster.url, p)), PROMPTS * 2))
    for prompt, answer in answers:
        assert answer["output_ids"] == expected[prompt], prompt[:40]
    for url in cluster.prefill_urls:
        assert lynx_state(url)["lynx_transfer"]["anchor_bytes"] > 0, f"{url} never sent"
    for url in cluster.decode_urls:
        assert lynx_state(url)["lynx_transfer"]["speculation"]["requests"] > 0, f"{url} never speculated"
    wait_decodes_idle(cluster, idle_decodes)


def wait_decodes_idle(cluster: PDCluster, idle_kv: list[int], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = [lynx_state(url) for url in cluster.decode_urls]
        figures = [(s["lynx_kv_available_tokens"], s["lynx_transfer"]["buffer_used"]) for s in states]
        if figures == [(kv, 0) for kv in idle_kv]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"decode (free KV, buffer used) {figures}, idle KV {idle_kv}")
        time.sleep(0.5)


# ---- the OpenAI API, through plain PD and through Lynx ---------------------------------

CLUSTERS = ["plain", "pd"]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}


def client_of(servers: dict, cluster: str) -> OpenAI:
    # No retries: a failure must show as it happened, not as the client's third try.
    return OpenAI(base_url=servers[cluster].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: OpenAI, **asked: Any) -> Any:
    messages = [{"role": "user", "content": "Name a colour."}]
    return client.chat.completions.create(model="default", messages=messages, **{**GREEDY, **asked})


def complete(client: OpenAI, **asked: Any) -> Any:
    return client.completions.create(model="default", **{"prompt": "Once", **GREEDY, **asked})


def same_as_plain(servers: dict, cluster: str, call: Callable[[OpenAI], Any]) -> Any:
    """``call``'s answer on ``cluster``; on Lynx's, first checked equal to plain PD's in
    everything the server decided (text, logprobs, finish reason, usage), both from empty
    prefix caches."""
    if cluster == "plain":
        return call(client_of(servers, cluster))
    flush_prefix_caches(servers)
    answer = call(client_of(servers, cluster))
    assert _decided(answer) == _decided(call(client_of(servers, "plain")))
    return answer


def flush_prefix_caches(servers: dict) -> None:
    """Empty every prefill's radix cache. A prompt the cache holds on one cluster's prefill
    and not on the other's is prefilled as a shorter extend there, whose products round
    differently on the CPU: with "Once" cached by an earlier test, every logprob differed by
    ~7e-4 (AVX2 host); on a host with oneDNN's avx512_bf16 kernels, with "Once upon a time"
    cached on Lynx's prefills by the first tests, the "Once" completion differed from its 7th
    token (2026-12-04; the same with the verify pass's early stop switched off, and equal
    from empty caches)."""
    for url in (*servers["pd"].prefill_urls, *servers["plain"].prefill_urls):
        flush_cache(url)


def _decided(answer: Any) -> dict:
    body = answer.model_dump()
    for volatile in ("id", "created", "system_fingerprint"):
        body.pop(volatile, None)
    return body


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_openai_chat_and_completions(servers: dict, cluster: str) -> None:
    answer = same_as_plain(servers, cluster, chat)
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 16
    text = same_as_plain(servers, cluster, complete)
    assert text.choices[0].text and text.choices[0].finish_reason == "length"


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_openai_streaming_with_usage(servers: dict, cluster: str) -> None:
    whole = same_as_plain(servers, cluster, chat)
    chunks = list(chat(client_of(servers, cluster), stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_openai_logprobs(servers: dict, cluster: str) -> None:
    answer = same_as_plain(servers, cluster, lambda c: chat(c, logprobs=True, top_logprobs=3))
    positions = answer.choices[0].logprobs.content
    assert len(positions) == 16 and all(len(p.top_logprobs) == 3 for p in positions)
    text = same_as_plain(servers, cluster, lambda c: complete(c, logprobs=3)).choices[0]
    assert len(text.logprobs.token_logprobs) == 16 and all(len(t) == 3 for t in text.logprobs.top_logprobs)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_openai_constrained_output(servers: dict, cluster: str) -> None:
    """json_schema, SGLang's regex, and stop: each constraint holds, and Lynx decides as
    plain PD does."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    formatted = same_as_plain(
        servers, cluster, lambda c: chat(c, max_tokens=32, extra_body={}, response_format=response_format)
    ).choices[0]
    # The grammar allows any whitespace between the tokens, and a random model wanders there:
    # what is not whitespace must be a start of an answer the schema allows (all of it, if
    # the model stopped).
    compact = "".join(formatted.message.content.split())
    answers = ('{"answer":"yes"}', '{"answer":"no"}')
    if formatted.finish_reason == "stop":
        assert json.loads(formatted.message.content)["answer"] in ("yes", "no")
    assert compact and any(answer.startswith(compact) for answer in answers), formatted.message.content
    colours = ("red", "green", "blue")
    regex = {"regex": "(red|green|blue)"}
    matched = same_as_plain(servers, cluster, lambda c: complete(c, max_tokens=8, extra_body=regex))
    assert matched.choices[0].text in colours
    words = complete(client_of(servers, "plain")).choices[0].text.split()
    stop = words[len(words) // 2]
    stopped = same_as_plain(servers, cluster, lambda c: complete(c, stop=[stop]))
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_openai_bad_inputs_get_a_clear_4xx(servers: dict, cluster: str) -> None:
    """Never a 500 or a hang: a negative max_tokens (the router refuses it: 422), and a
    prompt longer than the context."""
    client = client_of(servers, cluster)
    for asked, status, said in (
        ({"max_tokens": -1}, 422, "max_tokens"),
        ({"prompt": "Once upon a time " * 3000}, 400, "context"),
    ):
        with pytest.raises(openai.APIStatusError) as refused:
            complete(client, **asked)
        assert refused.value.status_code == status and said in refused.value.message, refused.value


def test_openai_client_hanging_up_while_tokens_are_held_frees_decode(
    servers: dict, idle_decodes: list[int]
) -> None:
    """The client gives up 0.3 s into a streamed request, while decode holds its tokens on
    the Anchor (the Residual lands 1 s late): the request is aborted and decode's pages and
    receive buffer come back. Each asks for 3,000 tokens, which this tiny model decodes in
    about a minute (15-50 steps a second here): idle within 20 s, only an abort freed them."""
    impatient = client_of(servers, "pd").with_options(timeout=0.3)
    for _ in range(3):
        with pytest.raises((openai.APITimeoutError, httpx.TimeoutException)):
            list(complete(impatient, prompt=PROMPTS[3], stream=True, max_tokens=3000))
    started = time.monotonic()
    wait_decodes_idle(servers["pd"], idle_decodes, timeout_s=20.0)
    print(f"decode idle {time.monotonic() - started:.2f} s after the last hang-up")


@pytest.mark.parametrize(
    "cluster",
    [
        pytest.param(
            "plain",
            marks=pytest.mark.xfail(
                strict=True,
                reason="upstream PD gives every parallel sample the request's one bootstrap room "
                "and never answers (issue 27); the plugin leaves plain PD as upstream made it",
            ),
        ),
        "pd",
    ],
)
def test_openai_n_samples_with_a_seed(servers: dict, cluster: str) -> None:
    client = client_of(servers, cluster).with_options(timeout=20)
    answer = complete(client, n=3, seed=1, temperature=0.8)
    assert len(answer.choices) == 3 and len({c.text for c in answer.choices}) > 1
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]


def test_greedy_samples_through_lynx_each_equal_plain_pds_answer(
    servers: dict, idle_decodes: list[int]
) -> None:
    """n = 4 greedy through the router: four choices, each plain PD's one answer token for
    token; each sample held tokens on its own Anchor and verified them (the Residual lands
    late), and the prompt's KV crossed the link once per sample."""
    flush_prefix_caches(servers)
    single = complete(client_of(servers, "plain"))
    answer = complete(client_of(servers, "pd"), n=4)
    assert [c.text for c in answer.choices] == [single.choices[0].text] * 4
    assert answer.usage.completion_tokens == 4 * single.usage.completion_tokens
    one = generate(servers["pd"].url, PROMPTS[3])
    body = {
        "text": PROMPTS[3],
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "n": 4},
    }
    samples = http_json(servers["pd"].url + "/generate", body)
    assert [s["output_ids"] for s in samples] == [one["output_ids"]] * 4
    reports = [s["meta_info"]["lynx_transfer"][-1] for s in samples]
    assert all(r["speculation"]["held"] > 0 for r in reports), reports
    sent = [r["anchor_bytes"] + r["residual_bytes"] for r in reports]
    alone = one["meta_info"]["lynx_transfer"][-1]
    once = alone["anchor_bytes"] + alone["residual_bytes"]
    print(f"n = 4: {sum(sent)} bytes over the link ({sent} per sample); n = 1: {once}")
    # Each sample sends the whole prompt: the same Anchor, and a lossless Residual of the
    # same size up to its coding. Its length follows the KV's bits, which a prefill whose
    # prefix cache held the prompt computes in a shorter extend: on oneDNN's avx512_bf16
    # kernels that moved 32 of 836,048 bytes (2026-12-04), the outputs equal.
    assert [r["anchor_bytes"] for r in reports] == [alone["anchor_bytes"]] * 4
    assert all(abs(n - once) <= once // 1000 for n in sent), (sent, once)
    wait_decodes_idle(servers["pd"], idle_decodes)


def test_two_live_requests_with_one_rid_each_get_their_answer_or_a_clear_refusal(
    servers: dict, idle_decodes: list[int]
) -> None:
    """Two clients send one request id at once, both held on their Anchors. Lynx keeps a
    request's state by its room, never by the client's id; upstream's tokenizer refuses a
    second live request with an id it is serving (HTTP 400) on either server. Every client
    gets the exact answer or that refusal, never a 500 or a hang, and decode comes back
    idle."""
    cluster = servers["pd"]
    expected = generate(servers["plugin"].url, PROMPTS[3])["output_ids"]
    body = {
        "text": PROMPTS[3],
        "rid": "one-rid-for-two",
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
    }
    outcomes: list[dict | tuple[int, str]] = []

    def one() -> None:
        try:
            outcomes.append(http_json(cluster.url + "/generate", body))
        except urllib.error.HTTPError as exc:
            outcomes.append((exc.code, exc.read().decode(errors="replace")))

    with ThreadPoolExecutor(2) as pool:
        for _ in range(2):
            pool.submit(one)
    print("outcomes:", [o if isinstance(o, tuple) else "answered" for o in outcomes])
    answered = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if isinstance(o, tuple)]
    assert len(outcomes) == 2 and answered, refused
    assert all(a["output_ids"] == expected for a in answered)
    assert all(400 <= code < 500 and "Duplicate request ID" in text for code, text in refused), refused
    wait_decodes_idle(cluster, idle_decodes)


def test_a_killed_prefill_fails_only_its_own_requests(servers: dict, idle_decodes: list[int]) -> None:
    """Runs last: it kills the second prefill server while it has Lynx transfers in
    flight. On decode those requests fail alone, with a clear error, at the transfer
    deadline, and their pages are freed; the router retries them on the prefill left
    (its default), so every client gets the exact answer or a clear error; the router goes
    on serving through the prefill left."""
    cluster = servers["pd"]
    victim = cluster.processes[1]
    assert victim.name == "prefill-1" and victim.process is not None
    expected = {prompt: generate(servers["plugin"].url, prompt)["output_ids"] for prompt in PROMPTS}

    def failed_on_decode() -> int:
        # Before its Anchor lands a request fails in upstream's transfer poll (the prefill's
        # connection is lost); after, in Lynx's (its Residual misses the deadline).
        failures = re.compile(r"Decode transfer failed for request|Lynx: request \S+ \(room \d+\) failed")
        logs = [path for path in cluster.log_paths if path.stem.startswith("decode")]
        return sum(len(failures.findall(path.read_text(errors="replace"))) for path in logs)

    before = failed_on_decode()
    outcomes: list[tuple[str, dict | str]] = []

    def one(prompt: str) -> None:
        try:
            outcomes.append((prompt, generate(cluster.url, prompt)))
        except urllib.error.HTTPError as exc:
            outcomes.append((prompt, exc.read().decode(errors="replace")))

    with ThreadPoolExecutor(12) as pool:
        for prompt in PROMPTS * 2:
            pool.submit(one, prompt)
        # Kill it while it has Lynx transfers in flight (the Residual is held 1 s).
        deadline = time.monotonic() + 120
        while lynx_state(cluster.prefill_urls[1])["lynx_transfer"]["rooms"] == 0:
            assert time.monotonic() < deadline, "prefill-1 never got a request"
            time.sleep(0.05)
        os.killpg(victim.process.pid, signal.SIGKILL)
    assert len(outcomes) == 2 * len(PROMPTS)
    for prompt, out in outcomes:
        if isinstance(out, str):
            assert out.strip(), "a failed request must say why"
        else:
            assert out["output_ids"] == expected[prompt], prompt[:40]
    print("client errors:", [out[:200] for _, out in outcomes if isinstance(out, str)])
    wait_decodes_idle(cluster, idle_decodes)
    assert failed_on_decode() > before, "no request was in flight on the killed prefill"
    # The router stops sending to the dead prefill within seconds; then every answer is exact.
    deadline = time.monotonic() + 120
    while True:
        try:
            answers = [generate(cluster.url, prompt) for prompt in PROMPTS[:4]]
            break
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline, "the router did not recover from a dead prefill"
            time.sleep(2.0)
    for prompt, answer in zip(PROMPTS[:4], answers, strict=True):
        assert answer["output_ids"] == expected[prompt]
    wait_decodes_idle(cluster, idle_decodes)
