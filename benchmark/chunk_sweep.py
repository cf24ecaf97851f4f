"""Plain PD and Lynx at each chunked-prefill size, side by side in one run: the honest
baseline for streaming the KV while prefill computes (issue #29).

Upstream already sends a request's KV chunk by chunk as chunked prefill computes it: a
smaller ``--chunked-prefill-size`` overlaps plain PD's transfer with its compute (at some
cost in prefill time), and Lynx sends each chunk's Anchor ahead of every pending
Residual. So Lynx is compared with plain PD at the default chunk and at plain PD's best
chunk for the link, not only at one size.

For each ``--chunks`` size, each ``--configs`` configuration (pd_transfer.CONFIGS) gets a
fresh prefill + decode pair (pd_transfer.Pair, ``--link`` as there), one warm-up request,
then the same ``--repeats`` real-text prompts of each ``--contexts`` length, each one
streamed greedy request of ``max(--marks)`` tokens. Sizes run one after the other, the
configurations of a size back to back, so a drifting host touches every configuration of
a size alike. With ``--interleave`` every configuration's pair of a size is up at once and
each prompt goes to each configuration in turn (the order reversed every other prompt):
a host whose speed drifts within minutes (a shared one) then touches them alike prompt
by prompt; the other pairs sit idle meanwhile, their servers up. Per (configuration,
size): TTFT and the time to each mark (medians), KV bytes per request, and the ratios to
plain PD (``bf16``) at ``--default-chunk`` and at its best size (its lowest median TTFT
per context). Prints a markdown table, writes
``chunk_sweep.json`` and ``chunk_sweep.png`` (TTFT and each mark against the chunk size,
one line per configuration) to ``--out``.

    sudo PYTHONPATH=python:benchmark .venv/bin/python benchmark/chunk_sweep.py \\
        --link 20mbit --contexts 2048 --repeats 3 --chunks 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench_texts import benchmark_parser, fetch_texts, machine, resolved_dtype
from pd_transfer import (
    CONFIGS,
    Pair,
    add_pair_options,
    bf16_bytes_per_token,
    measure,
    measure_one,
    median_of,
    prompts_from,
    rerun_on_decode_side,
)
from transformers import AutoTokenizer

from lynx.tools.cluster import terminate_on_sigterm

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "bf16"
# configuration -> chunk size -> one record per request (pd_transfer.measure)
Runs = dict[str, dict[int, list[dict[str, Any]]]]
DEFAULT_CONFIGS = [BASELINE, "lynx-speculative"]


def label(context: int, n: int) -> str:
    return f"ttft_{context}" if n == 1 else f"t{n}_{context}"


def summarize(runs: Runs, contexts: list[int], marks: list[int], default_chunk: int) -> list[dict[str, Any]]:
    """One row per (configuration, chunk size): medians, bytes, and ratios to plain PD at
    ``default_chunk`` and at its best size per context (by median TTFT)."""
    base = runs[BASELINE]
    best = {c: min(base, key=lambda size: median_of(base[size], c, 1)) for c in contexts}
    rows = []
    for config, by_chunk in runs.items():
        for size, mine in by_chunk.items():
            row: dict[str, Any] = {"config": config, "chunk": size}
            sizes = [r["kv_bytes"] for r in mine]
            row["kv_bytes_per_request"] = None if None in sizes else sorted(sizes)[len(sizes) // 2]
            for c in contexts:
                row[f"best_bf16_chunk_{c}"] = best[c]
                for n in (1, *marks):
                    key = label(c, n)
                    row[key] = median_of(mine, c, n)
                    row[f"{key}_vs_default"] = row[key] / median_of(base[default_chunk], c, n)
                    row[f"{key}_vs_best"] = row[key] / median_of(base[best[c]], c, n)
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], contexts: list[int], marks: list[int], default_chunk: int) -> str:
    points = [(c, n) for c in contexts for n in (1, *marks)]
    heads = [f"{'TTFT' if n == 1 else f'token {n}'} {c}" for c, n in points]
    lines = [
        "| config | chunk | KV bytes/request | " + " | ".join(heads) + " |",
        "|---|---:|---:|" + "---:|" * len(points),
    ]
    for row in rows:
        size = "n/a" if row["kv_bytes_per_request"] is None else f"{row['kv_bytes_per_request']:,}"
        cells = [
            f"{row[label(c, n)]:.1f} s ({row[f'{label(c, n)}_vs_default']:.2f} / "
            f"{row[f'{label(c, n)}_vs_best']:.2f})"
            for c, n in points
        ]
        lines.append(f"| {row['config']} | {row['chunk']} | {size} | " + " | ".join(cells) + " |")
    best = ", ".join(f"{c} tokens: {rows[0][f'best_bf16_chunk_{c}']}" for c in contexts)
    lines.append(f"\n(ratio to plain PD at chunk {default_chunk} / at its best chunk: {best}); medians")
    return "\n".join(lines)


def plot(runs: Runs, contexts: list[int], marks: list[int], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [1, *marks]
    sizes = sorted(runs[BASELINE])
    fig, axes = plt.subplots(
        len(contexts), len(panels), figsize=(6 * len(panels), 4 * len(contexts)), squeeze=False
    )
    for row, c in zip(axes, contexts, strict=True):
        for ax, n in zip(row, panels, strict=True):
            for config, by_chunk in runs.items():
                ax.plot(sizes, [median_of(by_chunk[s], c, n) for s in sizes], marker="o", label=config)
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_xlabel("--chunked-prefill-size (tokens)")
            ax.set_ylabel(("TTFT" if n == 1 else f"time to token {n}") + f", {c}-token prompt (s)")
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def turn_order(configs: list[str], prompt: int) -> list[str]:
    """The order the configurations serve the ``prompt``-th prompt in, interleaved: as
    given, reversed every other prompt, so neither serves first more often (the first
    after a pause can find the host's caches cold)."""
    return list(configs) if prompt % 2 == 0 else list(reversed(configs))


def interleaved(
    pairs: dict[str, Pair], prompts: dict[int, list[str]], marks: list[int]
) -> dict[str, list[dict[str, Any]]]:
    """One warm-up request per pair, then each prompt to every pair in :func:`turn_order`:
    per configuration, one record per request (pd_transfer.measure_one)."""
    for pair in pairs.values():
        pair.generate("warm up", 2)
    runs: dict[str, list[dict[str, Any]]] = {config: [] for config in pairs}
    items = [(context, index, text) for context, texts in prompts.items() for index, text in enumerate(texts)]
    for n, (context, index, text) in enumerate(items):
        for config in turn_order(list(pairs), n):
            runs[config].append(measure_one(pairs[config], context, index, text, marks, 0))
    return runs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__)
    add_pair_options(parser, chunk=False)
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument(
        "--default-chunk", type=int, help="plain PD's size the ratios start from (default: the largest swept)"
    )
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="every configuration's pair up at once, each prompt to each configuration in turn",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/chunk_sweep")
    args = parser.parse_args(argv)
    if len(set(args.configs)) < len(args.configs):
        parser.error(f"--configs must be distinct: {args.configs}")
    if BASELINE not in args.configs:
        parser.error(f"--configs must include {BASELINE} (plain PD: every ratio is to it)")
    if min(args.chunks) < 1 or len(set(args.chunks)) < len(args.chunks):
        parser.error(f"--chunks must be distinct positive sizes: {args.chunks}")
    args.default_chunk = args.default_chunk or max(args.chunks)
    if args.default_chunk not in args.chunks:
        parser.error(f"--default-chunk {args.default_chunk} is not among --chunks {args.chunks}")
    args.dtype = resolved_dtype(args.dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (status := rerun_on_decode_side(args)) is not None:
        return status
    started = time.time()
    where = machine()
    fetch_texts(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = {c: prompts_from(args.data, tokenizer, args.repeats, c, skip=1000) for c in args.contexts}
    runs: Runs = {config: {} for config in args.configs}
    with terminate_on_sigterm():
        for size in args.chunks:
            sized = argparse.Namespace(**{**vars(args), "chunk": size})
            if args.interleave:
                print(f"== {', '.join(args.configs)} interleaved, chunk {size}", flush=True)
                with ExitStack() as stack:
                    pairs = {
                        config: stack.enter_context(
                            Pair(
                                f"{config}-{size}",
                                CONFIGS[config],
                                sized,
                                args.out / "logs" / f"{config}-{size}",
                            )
                        )
                        for config in args.configs
                    }
                    for config, records in interleaved(pairs, prompts, args.marks).items():
                        runs[config][size] = records
            else:
                for config in args.configs:
                    print(f"== {config}, chunk {size}", flush=True)
                    log_dir = args.out / "logs" / f"{config}-{size}"
                    with Pair(f"{config}-{size}", CONFIGS[config], sized, log_dir) as pair:
                        runs[config][size] = measure(pair, prompts, args.marks, 0)
            for config in args.configs:
                ttfts = [round(r["times"][1], 2) for r in runs[config][size]]
                print(f"  {config}: TTFT {ttfts} s", flush=True)
    rows = summarize(runs, args.contexts, args.marks, args.default_chunk)
    link = args.link or "loopback"
    print(f"\n{args.model.name}, {args.dtype}, {link} link; {args.repeats} prompt(s) per point")
    print(table(rows, args.contexts, args.marks, args.default_chunk))
    wall_s = time.time() - started
    report = {
        "command": sys.argv,
        "machine": where,
        "interleaved": bool(args.interleave),
        "model": args.model.name,
        "bf16_bytes_per_token": bf16_bytes_per_token(args.model),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "wall_s": wall_s,
        "raw": runs,
    }
    (args.out / "chunk_sweep.json").write_text(json.dumps(report, indent=1))
    title = f"{args.model.name}, {link} link, {args.dtype}: plain PD and Lynx by chunked-prefill size"
    plot(runs, args.contexts, args.marks, title, args.out / "chunk_sweep.png")
    print(f"wrote {args.out}/chunk_sweep.json and chunk_sweep.png; wall time {wall_s / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
