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
from pathlib import Path

from bench_texts import benchmark_parser
from pd_transfer import Pair, prompts_from
from transformers import AutoTokenizer

from lynx.tools.cluster import http_json

ROOT = Path(__file__).resolve().parents[1]


COUNTERS = ("held_tokens", "accepted_tokens", "rejections", "verify_seconds", "refine_seconds")


def speculation_stats(pair: Pair) -> dict[str, float]:
    info = http_json(pair.servers["decode"].url + "/server_info")
    return info["internal_states"][0]["lynx_transfer"]["speculation"]


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
            # A streamed response carries the transfer report with its first chunk, before
            # verification: read what this request's verify pass did off the server's counters.
            before = speculation_stats(pair)
            _, times = pair.stream(prompt, marks)
            after = speculation_stats(pair)
            delta = {key: after[key] - before[key] for key in COUNTERS}
            committed = 1 + delta["accepted_tokens"] + delta["rejections"]
            tail = [n for n in marks if n > committed + 1]
            step_s = (times[tail[-1]] - times[tail[0]]) / (len(tail) - 1)
            rows.append(
                {
                    "context": context,
                    "held": delta["held_tokens"],
                    "accepted": delta["accepted_tokens"],
                    "refine_s": delta["refine_seconds"],
                    "verify_s": delta["verify_seconds"],
                    "decode_step_s": step_s,
                    "verify_in_steps": delta["verify_seconds"] / step_s,
                    "refine_in_steps": delta["refine_seconds"] / step_s,
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
