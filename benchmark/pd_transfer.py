"""PD serving with and without Lynx: TTFT on a rate-limited link, greedy agreement, bytes.

Four configurations, each a real prefill + decode pair, run one after the other so they
never share the 2 cores: plain BF16 PD (upstream's raw page copy), Lynx ``full`` (INT8:
Anchor + Residual before decoding), Lynx ``anchor-only`` (decode on the Anchor, the
Residual is never sent) and Lynx ``speculative`` (decode on the Anchor, hold the tokens,
verify when the Residual lands). With ``--link RATE`` (root, iproute2) the prefill runs in
network namespace lynx-a and the decode server and this driver in lynx-b, joined by a veth
pair limited to RATE each way (lynx.tools.netlink): KV crosses a slow link, as in the
paper. Requests go to both servers with the bootstrap fields the router would add.

Measured per configuration:
* TTFT and the time to each ``--marks`` token (one streamed greedy request: prefill
  + KV transfer + decoding; speculative mode streams only verified tokens) of
  ``--repeats`` prompts at each ``--contexts`` length, cut from real text;
* greedy agreement with BF16 PD over ``--prompts`` real prompts of ``--prompt-tokens``
  tokens, ``--gen`` new tokens each: the share of identical outputs and of the tokens
  before the first difference;
* KV bytes per prompt token on the wire (from each response's ``meta_info``; for BF16
  the pool's bytes per token).

Prints a markdown table, writes JSON and a PNG to ``--out`` (benchmark/results/...).
Inputs as in benchmark/codec_accuracy.py (``--data``, default /tmp/lynxdata).

    sudo PYTHONPATH=python .venv/bin/python benchmark/pd_transfer.py --link 20mbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench_texts import DOCS, PLAYS, benchmark_parser, dtype_args, fetch_texts
from bench_texts import TEXTS as BASE_TEXTS
from transformers import AutoTokenizer

from lynx.tools import netlink
from lynx.tools.cluster import (
    ServerConfig,
    SingleServer,
    free_port,
    http_json,
    pd_body,
    pd_generate,
    start_together,
    stop_together,
)

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [*BASE_TEXTS, f"{DOCS}/tutorial/classes.rst.txt", f"{PLAYS}/othello_gut.txt"]
CONFIGS: dict[str, list[str]] = {
    "bf16": [],
    "lynx-full": ["--lynx"],
    # ``full`` as it was before the Anchor streamed layer by layer: #29's "today's full"
    "lynx-full-chunkwise": ["--lynx", "--lynx-layerwise-from", "0"],
    "lynx-anchor-only": ["--lynx", "--lynx-mode", "anchor-only"],
    "lynx-speculative": ["--lynx", "--lynx-mode", "speculative"],
    # the verify pass all after the Residual landed (the default runs a parked request's
    # rows through each layer as it lands)
    "lynx-speculative-steps": ["--lynx", "--lynx-mode", "speculative", "--lynx-verify-pass", "steps"],
    # each chunk's Anchor leaves once the chunk is computed (the default streams it layer by
    # layer as prefill computes it, from 2,048 tokens) ...
    "lynx-speculative-chunkwise": ["--lynx", "--lynx-mode", "speculative", "--lynx-layerwise-from", "0"],
    # ... and from 256 tokens
    "lynx-speculative-layerwise": ["--lynx", "--lynx-mode", "speculative", "--lynx-layerwise-from", "256"],
}
SIDES = {"prefill": netlink.PREFILL, "decode": netlink.DECODE}


def prompts_from(data: Path, tokenizer: Any, n: int, tokens: int, skip: int) -> list[str]:
    """``n`` windows of ``tokens`` tokens from the texts, round robin, each from a new place."""
    ids = [tokenizer(Path(data, name).read_text(errors="replace")).input_ids for name in TEXTS]
    out = []
    for i in range(n):
        text = ids[i % len(ids)]
        start = skip + (i // len(ids)) * tokens
        if start + tokens > len(text):
            raise SystemExit(f"{TEXTS[i % len(ids)]} is too short for {tokens} tokens at {start}")
        out.append(tokenizer.decode(text[start : start + tokens]))
    return out


class Pair:
    """A prefill and a decode server, optionally each in its namespace."""

    def __init__(
        self,
        name: str,
        flags: list[str],
        args: argparse.Namespace,
        log_dir: Path,
        decode_flags: list[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: more environment for both servers (e.g. ``PYTHONPATH``)."""
        self.bootstrap_port = free_port()
        common = ["--disable-radix-cache", "--chunked-prefill-size", str(args.chunk), *dtype_args(args.dtype)]
        pd = ["--disaggregation-transfer-backend", "mooncake_tcp"]
        self.servers = {}
        for side in ("prefill", "decode"):
            config = ServerConfig(
                model_path=args.model,
                max_total_tokens=args.max_total_tokens,
                extra_args=common,
                env=dict(env or {}),
            )
            if args.link:
                config = SIDES[side].configure(config)
            extra = (
                ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
                if side == "prefill"
                else (decode_flags or [])
            )
            self.servers[side] = SingleServer(
                config,
                log_dir,
                name=f"{name}-{side}",
                args=[*flags, *pd, "--disaggregation-mode", side, *extra],
            )

    def __enter__(self) -> Pair:
        # Together: each start is minutes of imports on a 2-core host, and decode waits for
        # no prefill at start (they meet per request, through the bootstrap server).
        start_together(list(self.servers.values()), timeout_s=1200)
        return self

    def __exit__(self, *exc: object) -> None:
        stop_together(list(self.servers.values()))

    def _generate(self, prompt: str, max_new_tokens: int, on_chunk: Any = None) -> dict:
        prefill = self.servers["prefill"].url
        host = prefill.split("//")[1].rsplit(":", 1)[0]
        body = pd_body(prompt, self.bootstrap_port, max_new_tokens, bootstrap_host=host)
        return pd_generate(prefill, self.servers["decode"].url, body, 1800, on_chunk=on_chunk)

    def stream(self, prompt: str, marks: list[int]) -> tuple[dict, dict[int, float]]:
        """(last chunk, {n: seconds until the n-th token streamed} for n = 1 and ``marks``) of
        a streamed request of ``max(marks)`` tokens."""
        times: dict[int, float] = {}
        start = time.perf_counter()

        def mark(chunk: dict) -> None:
            now = time.perf_counter() - start
            for n in (1, *marks):
                if n not in times and len(chunk["output_ids"]) >= n:
                    times[n] = now

        chunk = self._generate(prompt, max(marks), on_chunk=mark)
        assert set(times) == {1, *marks}, chunk
        return chunk, times

    def generate(self, prompt: str, max_new_tokens: int) -> tuple[dict, float]:
        start = time.perf_counter()
        answer = self._generate(prompt, max_new_tokens)
        return answer, time.perf_counter() - start


def final_report(answer: dict) -> dict | None:
    """Lynx's final transfer report of a request (``meta_info["lynx_transfer"]``: a
    stream's last chunk ends with it), None without Lynx."""
    reports = answer["meta_info"].get("lynx_transfer")
    return reports[-1] if reports else None


PREFILL_COUNTERS = ("layers_streamed", "layer_encode_s", "lanes_driver_cpu_s", "lanes_polls")
"""What a Lynx prefill's ``/server_info`` counts, recorded per request (``prefill``)."""


def prefill_counters(pair: Pair) -> dict[str, float]:
    """``PREFILL_COUNTERS`` of the pair's prefill now ({} without Lynx)."""
    info = http_json(pair.servers["prefill"].url + "/server_info", timeout=30)
    stats = info["internal_states"][0].get("lynx_transfer") or {}
    return {key: stats[key] for key in PREFILL_COUNTERS if key in stats}


def measure(pair: Pair, prompts: dict[int, list[str]], marks: list[int], round_: int) -> list[dict[str, Any]]:
    """A warm-up request, then each prompt once, streamed: one record per request
    (:func:`measure_one`; requests run one at a time)."""
    pair.generate("warm up", 2)
    return [
        measure_one(pair, context, index, text, marks, round_)
        for context, texts in prompts.items()
        for index, text in enumerate(texts)
    ]


def measure_one(
    pair: Pair, context: int, index: int, text: str, marks: list[int], round_: int
) -> dict[str, Any]:
    """Prompt ``index`` of the ``context``-token ones, streamed: its record, with what the
    prefill counted during it."""
    before = prefill_counters(pair)
    answer, times = pair.stream(text, marks)
    after = prefill_counters(pair)
    report = final_report(answer)
    return {
        "round": round_,
        "context": context,
        "prompt": index,
        "times": times,
        "prompt_tokens": answer["meta_info"]["prompt_tokens"],
        "kv_bytes": report["anchor_bytes"] + report["residual_bytes"] if report else None,
        "output_ids": answer["output_ids"],
        "report": report,
        "prefill": {key: after[key] - before[key] for key in after if key in before},
    }


def median_of(runs: list[dict[str, Any]], context: int, n: int) -> float:
    return statistics.median(r["times"][n] for r in runs if r["context"] == context)


def run_config(name: str, args: argparse.Namespace, agreement: list[str], ttft: dict[int, list[str]]) -> dict:
    log_dir = args.out / "logs"
    result: dict[str, Any] = {"outputs": [], "times": {}, "bytes_per_token": None, "speculation": []}
    with Pair(name, CONFIGS[name], args, log_dir) as pair:
        pair.generate("warm up", 2)
        for context, prompts in ttft.items():
            runs = []
            for prompt in prompts:
                answer, times = pair.stream(prompt, args.marks)
                runs.append(times)
                final = final_report(answer)
                if final:
                    n = answer["meta_info"]["prompt_tokens"]
                    result["bytes_per_token"] = (final["anchor_bytes"] + final["residual_bytes"]) / n
                    if "speculation" in final:
                        result["speculation"].append(final["speculation"])
            result["times"][context] = {n: [run[n] for run in runs] for n in (1, *args.marks)}
            print(
                f"  {name} ctx {context}: "
                + ", ".join(
                    f"token {n} at {[round(t, 2) for t in ts]} s"
                    for n, ts in result["times"][context].items()
                ),
                flush=True,
            )
        for prompt in agreement:
            answer, _ = pair.generate(prompt, args.gen)
            result["outputs"].append(answer["output_ids"])
    return result


def agreement_of(outputs: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    same = sum(o == r for o, r in zip(outputs, reference, strict=True))
    prefix = sum(
        next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
        for o, r in zip(outputs, reference, strict=True)
    )
    total = sum(len(r) for r in reference)
    return {"identical_outputs": same / len(reference), "tokens_before_first_difference": prefix / total}


def bf16_bytes_per_token(model: Path) -> float:
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 2


def plot(results: dict, contexts: list[int], link: str, marks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [1, *marks]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4))
    draw_medians(axes, results, contexts, marks)
    fig.suptitle(f"PD serving, {args_model_name(results)} on 2 CPU cores, {link} link (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def draw_medians(axes: Any, results: dict, contexts: list[int], marks: list[int]) -> None:
    """On ``axes`` (one per panel: TTFT, then each of ``marks``), per context one bar per
    entry of ``results`` (labelled by its key): the median of its ``times[context][n]``."""
    width = 0.8 / len(results)
    for ax, n in zip(axes, [1, *marks], strict=True):
        for i, (name, res) in enumerate(results.items()):
            medians = [statistics.median(res["times"][c][n]) for c in contexts]
            ax.bar([j + i * width for j in range(len(contexts))], medians, width, label=name)
        ax.set_xticks(
            [j + width * (len(results) - 1) / 2 for j in range(len(contexts))], [str(c) for c in contexts]
        )
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s)" if n == 1 else f"time to token {n} (s)")
        ax.legend()


def args_model_name(results: dict) -> str:
    return next(iter(results.values())).get("model", "")


def rerun_on_decode_side(args: argparse.Namespace) -> int | None:
    """With ``--link``, outside the namespaces: fetch the texts (the namespaces reach no
    network) and run this same command again on decode's side; its exit status (2 where
    the link cannot be made). None: the caller goes on here."""
    if not args.link or netlink.inside():
        return None
    if (reason := netlink.unusable()) is not None:
        print(f"error: --link {reason}", file=sys.stderr)
        return 2
    fetch_texts(args.data)
    return netlink.run_on_side(netlink.DECODE, args.link, [sys.executable, *sys.argv])


def add_pair_options(parser: argparse.ArgumentParser, *, chunk: bool = True) -> None:
    """The options of the timed requests and of the servers' :class:`Pair` (``chunk``:
    with ``--chunk``; a caller that sweeps the size sets ``args.chunk`` itself)."""
    parser.add_argument("--link", default="", help="tbf rate between prefill and decode, e.g. 20mbit")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--marks", type=int, nargs="+", default=[32], help="timed requests report when these tokens streamed"
    )
    if chunk:
        parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--max-total-tokens", type=int, default=16384)


def main() -> None:
    parser = benchmark_parser(__doc__)
    add_pair_options(parser)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/pd_transfer")
    args = parser.parse_args()
    if (status := rerun_on_decode_side(args)) is not None:
        sys.exit(status)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    agreement = prompts_from(args.data, tokenizer, args.prompts, args.prompt_tokens, skip=1000)
    ttft = {
        c: prompts_from(args.data, tokenizer, args.repeats, c, skip=1000 + args.prompt_tokens * 3)
        for c in args.contexts
    }
    results = {}
    for name in args.configs:
        print(f"== {name}", flush=True)
        results[name] = run_config(name, args, agreement, ttft)
        results[name]["model"] = args.model.name
    results.setdefault("bf16", {})["bytes_per_token"] = bf16_bytes_per_token(args.model)
    reference = results.get("bf16", {}).get("outputs")

    def median(name: str, c: int, n: int) -> float | None:
        times = results.get(name, {}).get("times", {}).get(c, {}).get(n)
        return statistics.median(times) if times else None

    rows = []
    for name in args.configs:
        res = results[name]
        row: dict[str, Any] = {"config": name, "bytes_per_token": res["bytes_per_token"]}
        for c in args.contexts:
            for n in (1, *args.marks):
                label = f"ttft_{c}" if n == 1 else f"t{n}_{c}"
                row[label] = median(name, c, n)
                for base in ("bf16", "lynx-full", "lynx-anchor-only"):
                    if base != name and median(base, c, n):
                        row[f"{label}_vs_{base}"] = row[label] / median(base, c, n)
        if reference:
            row.update(agreement_of(res["outputs"], reference))
        if name == "lynx-speculative" and "lynx-full" in results:
            # same INT8 KV after refinement: greedy outputs should be identical
            row["identical_to_lynx_full"] = agreement_of(res["outputs"], results["lynx-full"]["outputs"])[
                "identical_outputs"
            ]
        if res.get("speculation"):
            held = sum(r["held"] for r in res["speculation"])
            row["acceptance"] = sum(r["accepted"] for r in res["speculation"]) / held if held else None
            row["mean_verify_s"] = statistics.mean(r["verify_s"] for r in res["speculation"])
            row["mean_refine_s"] = statistics.mean(r.get("refine_s", 0.0) for r in res["speculation"])
            row["mean_held"] = held / len(res["speculation"])
        rows.append(row)
    link = args.link or "loopback"
    print(
        f"\nlink: {link}; {args.repeats} prompts per point (medians); agreement over {args.prompts} prompts"
    )
    print(
        "| config | B/token | "
        + " | ".join(
            f"{'TTFT' if n == 1 else f'token {n}'} {c}" for c in args.contexts for n in (1, *args.marks)
        )
        + " |"
    )
    print("|---|---:|" + "---:|" * (len(args.contexts) * (1 + len(args.marks))))
    for row in rows:
        cells = []
        for c in args.contexts:
            for n in (1, *args.marks):
                label = f"ttft_{c}" if n == 1 else f"t{n}_{c}"
                ratio = row.get(f"{label}_vs_bf16")
                cells.append(f"{row[label]:.1f} s" + (f" ({ratio:.2f})" if ratio else ""))
        print(f"| {row['config']} | {row['bytes_per_token']:.0f} | " + " | ".join(cells) + " |")
    print("\nall figures:")
    for row in rows:
        print(json.dumps(row))
    summary = {"link": args.link, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    (args.out / "pd_transfer.json").write_text(json.dumps({**summary, "raw": results}, indent=1))
    plot(
        {n: results[n] for n in args.configs},
        args.contexts,
        link,
        args.marks,
        args.out / "pd_transfer_ttft.png",
    )
    print(f"wrote {args.out}/pd_transfer.json and pd_transfer_ttft.png")


if __name__ == "__main__":
    main()
