"""Decode throughput with and without upstream's overlap scheduler, in speculative and
full mode, side by side in one run.

For each mode, two prefill + decode pairs (loopback) differ only in the decode server's
``--disable-overlap-schedule``. Each round sends ``--clients`` concurrent streamed greedy
requests of ``--tokens`` tokens (prompts of ``--context`` tokens); speculative pairs hold
the Residual back ``--hold`` seconds, so every request decodes on its Anchor, parks at the
cap and is verified while the others decode. Decode throughput: committed tokens after
the first, over the span from the first request's first token to the last request's
last token (verification bubbles included). Prints a table with the overlap / no-overlap
ratio per mode and how many outputs equal the no-overlap pair's (greedy, but concurrent
requests batch differently from run to run, and on a random-weight model the CPU
kernels' rounding at other batch shapes flips near-ties; exactness itself is asserted by
the e2e tests), and writes JSON and a PNG plot to ``--out``.

    PYTHONPATH=python .venv/bin/python benchmark/overlap_decode.py \\
        --model ~/.cache/lynx/models/tiny-llama-s0
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_texts import benchmark_parser
from pd_transfer import Pair

from lynx.tools.soak import WORDS

ROOT = Path(__file__).resolve().parents[1]
NO_OVERLAP = ["--disable-overlap-schedule"]


def mode_flags(mode: str, args: argparse.Namespace) -> list[str]:
    if mode == "full":
        return ["--lynx", "--lynx-residual", "exact"]
    return [
        "--lynx",
        "--lynx-mode",
        "speculative",
        "--lynx-residual",
        "exact",
        "--lynx-max-speculative-tokens",
        str(args.cap),
        "--lynx-residual-hold",
        str(args.hold),
        "--lynx-transfer-deadline",
        str(args.hold + 120),
    ]


def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))


def one_round(pair: Pair, args: argparse.Namespace, round_no: int) -> tuple[float, list[list[int]]]:
    marks = [args.tokens]
    prompts = [prompt(round_no * args.clients + i, args.context) for i in range(args.clients)]
    with ThreadPoolExecutor(args.clients) as pool:
        runs = list(pool.map(lambda p: pair.stream(p, marks), prompts))
    first = min(times[1] for _, times in runs)
    last = max(times[args.tokens] for _, times in runs)
    return args.clients * (args.tokens - 1) / (last - first), [chunk["output_ids"] for chunk, _ in runs]


def measure(mode: str, overlap: bool, args: argparse.Namespace) -> dict:
    name = f"{mode}-{'overlap' if overlap else 'no-overlap'}"
    decode_flags = [] if overlap else NO_OVERLAP
    with Pair(name, mode_flags(mode, args), args, args.out / "logs", decode_flags) as pair:
        pair.generate("warm up", 4)
        rates, outputs = [], []
        for round_no in range(args.rounds):
            rate, out = one_round(pair, args, round_no)
            rates.append(rate)
            outputs.append(out)
            print(f"  {name} round {round_no}: {rate:.1f} tok/s", flush=True)
    return {
        "mode": mode,
        "overlap": overlap,
        "rates": rates,
        "median": statistics.median(rates),
        "outputs": outputs,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for k, overlap in enumerate((False, True)):
        values = [
            next(r["median"] for r in rows if r["mode"] == m and r["overlap"] == overlap) for m in modes
        ]
        ax.bar([i + (k - 0.5) * width for i in range(len(modes))], values, width, label=f"overlap {overlap}")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("decode tokens/s (median of rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--modes", nargs="+", default=["full", "speculative"])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=200, help="prompt length in words")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap", type=int, default=32)
    parser.add_argument("--hold", type=float, default=0.5)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/overlap_decode")
    args = parser.parse_args()
    args.link = ""
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [measure(mode, overlap, args) for mode in args.modes for overlap in (False, True)]
    print(f"\n{args.model.name}: {args.clients} clients x {args.tokens} tokens, {args.rounds} rounds")
    print("| mode | no overlap (tok/s) | overlap (tok/s) | overlap / no overlap | outputs equal |")
    print("|---|---:|---:|---:|---|")
    summary = []
    for mode in args.modes:
        off, on = (next(r for r in rows if r["mode"] == mode and r["overlap"] == o) for o in (False, True))
        rounds = zip(on["outputs"], off["outputs"], strict=True)
        pairs = [(a, b) for ra, rb in rounds for a, b in zip(ra, rb, strict=True)]
        equal = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        ratio = on["median"] / off["median"]
        summary.append(
            {
                "mode": mode,
                "no_overlap": off["median"],
                "overlap": on["median"],
                "ratio": ratio,
                "equal": equal,
            }
        )
        print(f"| {mode} | {off['median']:.1f} | {on['median']:.1f} | {ratio:.2f} | {equal} |")
    for r in rows:
        r.pop("outputs")
    (args.out / "overlap_decode.json").write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "summary": summary}, indent=1
        )
    )
    plot(rows, args.out / "overlap_decode.png")
    print(f"wrote {args.out}/overlap_decode.json and overlap_decode.png")


if __name__ == "__main__":
    main()
