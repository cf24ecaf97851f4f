"""What one verify pass costs, in decode steps, by phase (refine, forward), per context.

One speculative prefill + decode pair (loopback) serves one streamed greedy request per
``--contexts`` length: the Residual is held back ``--hold`` seconds, so the request holds
``--cap`` tokens on Anchor KV before its verify pass; it then decodes ``--after`` more
tokens at full precision. From the response's speculation report: the refine time (prompt
KV rewritten at full precision) and the verify forward (one decode row per held token);
from the stream: the median time between tokens after verification, i.e. one decode step
of this request at this context. Prints a table (verify cost in decode steps); writes JSON
to ``--out``.

    PYTHONPATH=python .venv/bin/python benchmark/verify_cost.py --contexts 512 1024 2048
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench_texts import benchmark_parser
from pd_transfer import Pair, prompts_from
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--cap", type=int, default=32)
    parser.add_argument("--after", type=int, default=24, help="tokens decoded after the verify pass")
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/verify_cost")
    args = parser.parse_args()
    args.link = ""
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    flags = [
        "--lynx",
        "--lynx-mode",
        "speculative",
        "--lynx-max-speculative-tokens",
        str(args.cap),
        "--lynx-residual-hold",
        str(args.hold),
        "--lynx-transfer-deadline",
        str(4 * args.hold + 600),
    ]
    rows = []
    with Pair("verify-cost", flags, args, args.out / "logs", ["--disable-overlap-schedule"]) as pair:
        pair.generate("warm up", 2)
        for context in args.contexts:
            (prompt,) = prompts_from(args.data, tokenizer, 1, context, skip=700)
            marks = list(range(2, args.cap + args.after + 1))
            answer, times = pair.stream(prompt, marks)
            report = answer["meta_info"]["lynx_transfer"][0].get("speculation") or {}
            committed = 1 + report.get("accepted", 0) + int(bool(report.get("rejected")))
            after = [times[n] - times[n - 1] for n in marks if n > committed + 1]
            step_s = statistics.median(after)
            rows.append(
                {
                    "context": context,
                    "held": report.get("held"),
                    "accepted": report.get("accepted"),
                    "refine_s": report.get("refine_s"),
                    "verify_s": report.get("verify_s"),
                    "decode_step_s": step_s,
                    "verify_in_steps": report.get("verify_s", 0.0) / step_s,
                    "refine_in_steps": report.get("refine_s", 0.0) / step_s,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.model.name}, held tokens up to {args.cap}, Residual held {args.hold} s")
    print(
        "| context | held | refine (s) | verify forward (s) | decode step (s) "
        "| verify in steps | refine in steps |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['context']} | {r['held']} | {r['refine_s']:.3f} | {r['verify_s']:.3f} "
            f"| {r['decode_step_s']:.3f} | {r['verify_in_steps']:.1f} | {r['refine_in_steps']:.1f} |"
        )
    (args.out / "verify_cost.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}/verify_cost.json")


if __name__ == "__main__":
    main()
