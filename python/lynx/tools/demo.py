"""The main job: prefill, decode and the PD router, on loopback or over a slow link.

    python -m lynx.tools.demo                       # SmolLM2-135M-Instruct, KV over Mooncake TCP
    python -m lynx.tools.demo --model tiny          # a random tiny Llama, starts faster
    python -m lynx.tools.demo --lynx-args "--lynx --lynx-mode full"
    python -m lynx.tools.demo --lynx-args ""        # plain upstream PD, for comparison
    python -m lynx.tools.demo --link 20mbit         # over a 20 Mbit/s link, next to plain PD (root)
    python -m lynx.tools.demo --attach http://router:8000 --decode-url http://decode:30000

It prepares the model if needed, starts the three processes (Lynx speculative mode by
default), sends one OpenAI chat completion through the router (streamed, to measure the
time to the first token), prints the answer, the TTFT, the KV bytes Lynx moved, when the
Anchor and the Residual landed (from decode's metrics: the demo starts it with
``--enable-metrics``) and what speculation did, and stops everything, also on Ctrl-C or a
failed start. With ``--attach`` it starts nothing and asks a cluster that already runs
(the docker compose cluster's check, scripts/compose.sh).

With ``--link RATE`` (root, iproute2) prefill runs in network namespace lynx-a, decode,
the router and the demo itself in lynx-b, joined by a link limited to RATE each way
(lynx.tools.netlink). The prompt asks for a summary of the first ``--prompt-tokens``
tokens of the repo's README.md and docs/*.md: enough KV that the Residual is still in
flight when decoding starts (a short question moves too few bytes). Then a second
cluster, plain upstream PD on the same link, answers the same prompt, and both TTFTs are
printed with their ratio. The namespaces are deleted on every way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from lynx.tools import models, netlink
from lynx.tools.cluster import ClusterError, PDCluster, ServerConfig, http_json, terminate_on_sigterm

REPO = Path(__file__).resolve().parents[3]
QUESTION = "In two sentences, why does KV-cache transfer slow down disaggregated LLM serving?"
SUMMARY_REQUEST = "Summarize this text in two sentences.\n\n"
# Decode's Prometheus metrics tell when a request's Anchor and Residual landed: the OpenAI
# response has no meta_info, and a streamed /generate's carries Lynx's transfer report as
# it was at the first token, before the Residual landed.
METRICS = ["--enable-metrics"]


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


# One sample line: name, optional {labels}, value (an optional timestamp follows).
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^\n]*\})?\s+(?P<value>\S+)", re.MULTILINE)


def metric_totals(text: str, names: Iterable[str]) -> dict[str, float]:
    """The values of the samples ``names`` in a Prometheus text exposition, each summed
    over its label sets; names without a sample are left out."""
    wanted = set(names)
    totals: dict[str, float] = {}
    for sample in _SAMPLE.finditer(text):
        if sample["name"] in wanted:
            totals[sample["name"]] = totals.get(sample["name"], 0.0) + float(sample["value"])
    return totals


# Receive space offered -> Anchor / Residual landed, per request (lynx.metrics).
LANDING = {"Anchor": "lynx_anchor_latency_seconds", "Residual": "lynx_residual_latency_seconds"}


def _landing_totals(decode_url: str) -> dict[str, float]:
    """Decode's landing-time histograms, sums and counts; empty without ``--enable-metrics``
    or without Lynx."""
    try:
        with urllib.request.urlopen(decode_url + "/metrics", timeout=60) as response:
            text = response.read().decode()
    except OSError:  # no /metrics: started without --enable-metrics (a cluster we attached to)
        return {}
    return metric_totals(text, [f"{name}_{part}" for name in LANDING.values() for part in ("sum", "count")])


def landing_times(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``{"Anchor": s, "Residual": s}``: how long after its receive space was offered each
    part of the one request between the two readings landed (a part that did not land
    exactly once in between is left out: not sent, or other requests ran)."""
    times = {}
    for part, name in LANDING.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count == 1:
            times[part] = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
    return times


def ask_and_report(router_url: str, decode_url: str, prompt: str, max_tokens: int) -> ChatResult:
    """One chat completion through the router, then what decode's Lynx did for it: the
    counters' growth over the request (nothing else runs meanwhile in the demo), and from
    decode's metrics (if it has them) when the request's Anchor and Residual landed."""
    before, landing_before = _lynx_counters(decode_url), _landing_totals(decode_url)
    result = chat_once(router_url, prompt, max_tokens)
    after, landing_after = _lynx_counters(decode_url), _landing_totals(decode_url)
    print(f"\nprompt: {_shown(prompt)}\nanswer: {result.answer.strip()}\n")
    print(
        f"TTFT: {result.ttft_s * 1000:.0f} ms   completion tokens: {result.completion_tokens}"
        f"   decode: {result.decode_tokens_per_s:.1f} tokens/s"
    )
    if before is None or after is None:
        print("Lynx: off on decode (plain upstream PD)")
        return result
    anchor = (after["anchor_bytes"] - before["anchor_bytes"]) / 1024
    residual = (after["residual_bytes"] - before["residual_bytes"]) / 1024
    print(f"Lynx KV received by decode: Anchor {anchor:.0f} KiB, Residual {residual:.0f} KiB")
    if landed := landing_times(landing_before, landing_after):
        print(
            "Lynx KV landed on decode: "
            + ", ".join(f"{part} at {seconds * 1000:.0f} ms" for part, seconds in landed.items())
            + " (from decode's reservation for the request, ~ its start)"
        )
    spec_before, spec_after = before.get("speculation"), after.get("speculation")
    if spec_after:
        grown = {k: spec_after[k] - (spec_before or {}).get(k, 0) for k in ("held_tokens", "accepted_tokens")}
        note = " (the Residual landed before decoding started; on a slow link it does not)"
        print(
            f"Lynx speculation: tokens held on the Anchor: {grown['held_tokens']}, "
            f"accepted: {grown['accepted_tokens']}{note if grown['held_tokens'] == 0 else ''}"
        )
    return result


def excerpt(tokenizer: Any, text: str, tokens: int) -> str:
    """The first ``tokens`` tokens of ``text`` (``tokenizer``: a Hugging Face tokenizer)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"error: the text has {len(ids)} tokens, fewer than the {tokens} asked for")
    return tokenizer.decode(ids[:tokens])


def repo_docs() -> str:
    """README.md and docs/*.md of this checkout: long real text, the same on every run."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    try:
        return "\n\n".join(path.read_text() for path in paths)
    except OSError as exc:
        raise SystemExit(f"error: --link's prompt is cut from the repo's docs: {exc}; pass --prompt") from exc


def ttft_comparison(rate: str, lynx_s: float, plain_s: float) -> str:
    return (
        f"TTFT over the {rate} link: Lynx {lynx_s:.2f} s, plain PD {plain_s:.2f} s "
        f"(Lynx / plain PD = {lynx_s / plain_s:.2f})"
    )


def over_link(args: argparse.Namespace, model: Path, lynx_args: list[str], log_dir: Path) -> None:
    """The demo with prefill and decode on the two sides of the link (this process runs on
    decode's), Lynx first, then plain PD (``--link``; see the module docstring)."""
    prefill, decode = netlink.PREFILL, netlink.DECODE
    print(
        f"link:  {args.link} each way between prefill ({prefill.netns}, {prefill.address}) and "
        f"decode + router + this client ({decode.netns}, {decode.address})"
    )
    prompt = args.prompt
    if prompt is None:
        from transformers import AutoTokenizer

        text = excerpt(AutoTokenizer.from_pretrained(model), repo_docs(), args.prompt_tokens)
        prompt = SUMMARY_REQUEST + text
        print(f"prompt: a summary of the first {args.prompt_tokens} tokens of README.md and docs/*.md")
    passes = {"Lynx": lynx_args, "plain PD": []} if lynx_args else {"plain PD": []}
    ttfts = {}
    for name, flags in passes.items():
        print(f"\n== {name} ({shlex.join(flags) or 'no Lynx flags'})")
        config = ServerConfig(model_path=model, cpu=not args.gpu, extra_args=flags)
        with PDCluster(
            config,
            log_dir / ("lynx" if flags else "plain"),
            decode_args=METRICS,
            prefill_config=prefill.configure(config),
            decode_config=decode.configure(config),
        ) as cluster:
            print(f"router: {cluster.url} (prefill {cluster.prefill_url}, decode {cluster.decode_url})")
            ttfts[name] = ask_and_report(cluster.url, cluster.decode_url, prompt, args.max_tokens).ttft_s
        print("servers stopped")
    if len(ttfts) == 2:
        print("\n" + ttft_comparison(args.link, ttfts["Lynx"], ttfts["plain PD"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lynx.tools.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model folder")
    parser.add_argument("--prompt", help=f'default: "{QUESTION}"; with --link: see --prompt-tokens')
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
        "--link",
        metavar="RATE",
        help="prefill and decode in two network namespaces joined by a link of RATE each way (tc syntax, "
        "e.g. 20mbit), then the same prompt over plain PD for comparison; needs root",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=1500,
        help="with --link and no --prompt: the prompt asks for a summary of the first this many tokens "
        "of the repo's README.md and docs/*.md (default 1500)",
    )
    parser.add_argument(
        "--attach", metavar="ROUTER_URL", help="ask this running router instead of starting a cluster"
    )
    parser.add_argument("--decode-url", help="with --attach: the decode server whose Lynx counters to show")
    args = parser.parse_args(argv)
    if (args.attach is None) != (args.decode_url is None):
        parser.error("--attach and --decode-url go together")
    if args.attach:
        if args.link:
            parser.error("--link starts its own cluster: not with --attach")
        try:
            ask_and_report(
                args.attach.rstrip("/"), args.decode_url.rstrip("/"), args.prompt or QUESTION, args.max_tokens
            )
        except OSError as exc:  # URLError, HTTPError and the client's connection errors
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.link and (reason := netlink.unusable()) is not None:
        parser.error(f"--link {reason}")

    log_dir = (args.log_dir or Path("logs") / f"demo-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    # Here, not on decode's side of the link: building a model may need the package index,
    # which the namespaces cannot reach.
    model = _model_path(args.model)
    if args.link and not netlink.inside():
        # Again on decode's side, with this model and log folder (argparse keeps the last of
        # a repeated flag).
        again = [*(sys.argv[1:] if argv is None else argv), "--model", str(model), "--log-dir", str(log_dir)]
        try:
            code = netlink.run_on_side(
                netlink.DECODE, args.link, [sys.executable, "-m", "lynx.tools.demo", *again]
            )
        except subprocess.CalledProcessError as exc:  # netlink.sh said why on stderr
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"link down: namespaces {netlink.PREFILL.netns} and {netlink.DECODE.netns} deleted")
        return code
    lynx_args = shlex.split(args.lynx_args)
    print(f"model: {model}")
    folders = "{lynx,plain}/" if args.link and lynx_args else "plain/" if args.link else ""
    print(f"logs:  {log_dir}/{folders}{{prefill,decode,router}}.log")
    try:
        with terminate_on_sigterm():
            if args.link:
                over_link(args, model, lynx_args, log_dir)
                return 0
            config = ServerConfig(model_path=model, cpu=not args.gpu, extra_args=lynx_args)
            with PDCluster(config, log_dir, decode_args=METRICS) as cluster:
                print(f"router: {cluster.url} (prefill {cluster.prefill_url}, decode {cluster.decode_url})")
                ask_and_report(cluster.url, cluster.decode_url, args.prompt or QUESTION, args.max_tokens)
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
