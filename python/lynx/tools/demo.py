"""The main job: a prefill server, a decode server and the PD router on loopback.

    python -m lynx.tools.demo                       # SmolLM2-135M-Instruct, KV over Mooncake TCP
    python -m lynx.tools.demo --model tiny          # a random tiny Llama, starts faster
    python -m lynx.tools.demo --lynx-args "--lynx --lynx-mode full"
    python -m lynx.tools.demo --lynx-args ""        # plain upstream PD, for comparison
    python -m lynx.tools.demo --attach http://router:8000 --decode-url http://decode:30000

It prepares the model if needed, starts the three processes (Lynx speculative mode by
default), sends one OpenAI chat completion through the router (streamed, to measure the
time to the first token), prints the answer, the TTFT, the KV bytes Lynx moved and what
speculation did, and stops everything, also on Ctrl-C or a failed start. With
``--attach`` it starts nothing and asks a cluster that already runs (the docker compose
cluster's check, scripts/compose.sh).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lynx.tools import models
from lynx.tools.cluster import ClusterError, PDCluster, ServerConfig, http_json, terminate_on_sigterm


def _model_path(choice: str) -> Path:
    if choice == "smollm2":
        return models.prepare_smollm2()
    if choice == "tiny":
        return models.prepare_tiny()
    path = Path(choice)
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: {path} is not a model folder (no config.json)")
    return path


@dataclass(frozen=True)
class ChatResult:
    answer: str
    ttft_s: float
    total_s: float
    completion_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.completion_tokens - 1) / max(self.total_s - self.ttft_s, 1e-9)


def chat_once(base_url: str, prompt: str, max_tokens: int) -> ChatResult:
    """One streamed chat completion, timed: TTFT is the first content chunk's arrival."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="unused")
    start = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage_tokens = 0
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(choice.delta.content)
    total = time.perf_counter() - start
    return ChatResult("".join(parts), ttft if ttft is not None else float("nan"), total, usage_tokens)


def _lynx_counters(decode_url: str) -> dict[str, Any] | None:
    """Decode's Lynx transfer counters (cumulative since it started), None without Lynx."""
    return http_json(decode_url + "/server_info")["internal_states"][0].get("lynx_transfer")


def _shown(prompt: str, limit: int = 200) -> str:
    return prompt if len(prompt) <= limit else f"{prompt[:limit]}... ({len(prompt)} characters)"


def ask_and_report(router_url: str, decode_url: str, prompt: str, max_tokens: int) -> None:
    """One chat completion through the router, then what decode's Lynx did for it: the
    counters' growth over the request (nothing else runs meanwhile in the demo)."""
    before = _lynx_counters(decode_url)
    result = chat_once(router_url, prompt, max_tokens)
    after = _lynx_counters(decode_url)
    print(f"\nprompt: {_shown(prompt)}\nanswer: {result.answer.strip()}\n")
    print(
        f"TTFT: {result.ttft_s * 1000:.0f} ms   completion tokens: {result.completion_tokens}"
        f"   decode: {result.decode_tokens_per_s:.1f} tokens/s"
    )
    if before is None or after is None:
        print("Lynx: off on decode (plain upstream PD)")
        return
    anchor = (after["anchor_bytes"] - before["anchor_bytes"]) / 1024
    residual = (after["residual_bytes"] - before["residual_bytes"]) / 1024
    print(f"Lynx KV received by decode: Anchor {anchor:.0f} KiB, Residual {residual:.0f} KiB")
    spec_before, spec_after = before.get("speculation"), after.get("speculation")
    if spec_after:
        grown = {k: spec_after[k] - (spec_before or {}).get(k, 0) for k in ("held_tokens", "accepted_tokens")}
        note = " (the Residual landed before decoding started; on a slow link it does not)"
        print(
            f"Lynx speculation: {grown['held_tokens']} tokens held on the Anchor, "
            f"{grown['accepted_tokens']} accepted{note if grown['held_tokens'] == 0 else ''}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lynx.tools.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model folder")
    parser.add_argument(
        "--prompt",
        default="In two sentences, why does KV-cache transfer slow down disaggregated LLM serving?",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="default: logs/demo-<time> under the current directory"
    )
    parser.add_argument("--gpu", action="store_true", help="serve on CUDA instead of the CPU engine")
    parser.add_argument(
        "--lynx-args",
        default="--lynx --lynx-mode speculative",
        help='flags for both servers (default "--lynx --lynx-mode speculative"; "" for plain upstream PD)',
    )
    parser.add_argument(
        "--attach", metavar="ROUTER_URL", help="ask this running router instead of starting a cluster"
    )
    parser.add_argument("--decode-url", help="with --attach: the decode server whose Lynx counters to show")
    args = parser.parse_args(argv)
    if (args.attach is None) != (args.decode_url is None):
        parser.error("--attach and --decode-url go together")
    if args.attach:
        try:
            ask_and_report(args.attach.rstrip("/"), args.decode_url.rstrip("/"), args.prompt, args.max_tokens)
        except OSError as exc:  # URLError, HTTPError and the client's connection errors
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0

    log_dir = args.log_dir or Path("logs") / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    model = _model_path(args.model)
    lynx_args = shlex.split(args.lynx_args)
    config = ServerConfig(model_path=model, cpu=not args.gpu, extra_args=lynx_args)
    print(f"model: {model}")
    print(f"logs:  {log_dir.resolve()}/{{prefill,decode,router}}.log")
    try:
        with terminate_on_sigterm(), PDCluster(config, log_dir) as cluster:
            print(f"router: {cluster.url} (prefill {cluster.prefill_url}, decode {cluster.decode_url})")
            ask_and_report(cluster.url, cluster.decode_url, args.prompt, args.max_tokens)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    print("servers stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
