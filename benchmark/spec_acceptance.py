"""How many tokens decoded on the Anchor survive verification, per Anchor width.

For each ``--bits`` value a real speculative prefill + decode pair (loopback) serves
``--prompts`` greedy requests of ``--prompt-tokens`` tokens of real text, ``--gen`` new
tokens each, all at once. The Residual is held back ``--hold`` seconds on prefill
(``--lynx-residual-hold``), long enough for every request to decode its
``--lynx-max-speculative-tokens`` (``--cap``) tokens on Anchor KV before verification,
so each verification judges a full run of held tokens. From each response's
``meta_info["lynx_transfer"][0]["speculation"]``:

* acceptance: accepted / held tokens (the accepted prefix of each run: after the first
  wrong token the rest is discarded whether or not it was right);
* agreement: held tokens equal to the full-precision argmax at their position, given the
  held tokens before them (teacher-forced on the draft: the per-token figure of
  ../shared/reference/acceptance-probe.md, where acceptance stops at the first miss);
* fully accepted: the share of requests whose whole held run was kept.

(Exactness of the committed output is the e2e tests' and benchmark/pd_transfer.py's
business.) Prints a table; writes JSON and a PNG to ``--out``.

    PYTHONPATH=python .venv/bin/python benchmark/spec_acceptance.py --bits 2 3 4
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_texts import MODEL_DIR
from pd_transfer import TEXTS, Pair, prompts_from
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]


def run_bits(bits: int, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    flags = [
        "--lynx",
        "--lynx-mode",
        "speculative",
        "--lynx-anchor-bits",
        str(bits),
        "--lynx-max-speculative-tokens",
        str(args.cap),
        "--lynx-residual-hold",
        str(args.hold),
        "--lynx-transfer-deadline",
        str(args.hold * 4 + 60),
    ]
    with Pair(f"spec-{bits}bit", flags, args, args.out / "logs", ["--disable-overlap-schedule"]) as pair:
        pair.generate("warm up", 2)
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: pair.generate(p, args.gen)[0], prompts))
    reports = [a["meta_info"]["lynx_transfer"][0].get("speculation") or {} for a in answers]
    held = sum(r.get("held", 0) for r in reports)
    accepted = sum(r.get("accepted", 0) for r in reports)
    agreed = sum(r.get("agreed") or 0 for r in reports)
    return {
        "bits": bits,
        "requests": len(reports),
        "held": held,
        "accepted": accepted,
        "acceptance": accepted / held if held else None,
        "agreement": agreed / held if held else None,
        "fully_accepted": sum(1 for r in reports if r.get("held") and not r.get("rejected")) / len(reports),
        "mean_held": held / len(reports),
        "reports": reports,
        "outputs": [a["output_ids"] for a in answers],
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(r["bits"]) for r in rows], [100 * (r["acceptance"] or 0) for r in rows])
    ax.set_xlabel("Anchor bits")
    ax.set_ylabel("held tokens accepted (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Speculative acceptance, SmolLM2-135M")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--data", type=Path, default=Path("/tmp/lynxdata"))
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--gen", type=int, default=40)
    parser.add_argument("--cap", type=int, default=32)
    parser.add_argument("--hold", type=float, default=20.0)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/spec_acceptance")
    args = parser.parse_args()
    args.link = ""
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = prompts_from(args.data, tokenizer, args.prompts, args.prompt_tokens, skip=500)
    rows = []
    for bits in args.bits:
        print(f"== {bits}-bit Anchors", flush=True)
        rows.append(run_bits(bits, prompts, args))
        print(f"  acceptance {rows[-1]['acceptance']}, agreement {rows[-1]['agreement']}", flush=True)
    print(
        f"\n{args.prompts} prompts x {args.prompt_tokens} tokens of {len(TEXTS)} texts, "
        f"gen {args.gen}, cap {args.cap}, Residual held {args.hold} s"
    )
    print("| anchor bits | held tokens | accepted | acceptance | per-token agreement | runs fully accepted |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['bits']} | {r['held']} | {r['accepted']} | {100 * (r['acceptance'] or 0):.1f}% "
            f"| {100 * (r['agreement'] or 0):.1f}% | {100 * r['fully_accepted']:.0f}% |"
        )
    (args.out / "spec_acceptance.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
    )
    plot(rows, args.out / "spec_acceptance.png")
    print(f"wrote {args.out}/spec_acceptance.json and spec_acceptance.png")


if __name__ == "__main__":
    main()
