"""What one verify pass costs, in decode steps, by phase (refine, forward), per context.

One speculative prefill + decode pair (loopback) serves one streamed greedy request per
``--contexts`` length: the Residual is held back ``--hold`` seconds, so the request holds
``--cap`` tokens on Anchor KV before its verify pass; it then decodes ``--after`` more
tokens at full precision. From the response's speculation report: the refine time (prompt
KV rewritten at full precision) and the verify pass (one decode row per held token);
from the stream: the median time between tokens after verification, i.e. one decode step
of this request at this context. ``--verify-pass`` runs one pair per way of running the
verify pass (side by side, same prompts) and says whether each one's output equals the
``steps`` pair's (the decode path's numerics). Prints a table (verify cost in decode
steps); writes JSON to ``--out``.

    PYTHONPATH=python .venv/bin/python benchmark/verify_cost.py --contexts 512 1024 2048
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--verify-pass", nargs="+", default=["batched", "steps"])
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
    prompts = {c: prompts_from(args.data, tokenizer, 1, c, skip=700)[0] for c in args.contexts}
    rows = []
    for verify_pass in args.verify_pass:
        rows += measure(args, [*flags, "--lynx-verify-pass", verify_pass], verify_pass, prompts)
    outputs = {(r["verify_pass"], r["context"]): r.pop("output_ids") for r in rows}
    for r in rows:
        own, reference = outputs[(r["verify_pass"], r["context"])], outputs.get(("steps", r["context"]))
        r["same_output_as_steps"] = None if reference is None else own == reference
    print(f"\n{args.model.name}, held tokens up to {args.cap}, Residual held {args.hold} s")
    print(
        "| verify pass | context | held | accepted | refine (s) | verify (s) | decode step (s) "
        "| verify in steps | refine in steps | output = steps' |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['verify_pass']} | {r['context']} | {r['held']} | {r['accepted']} | {r['refine_s']:.3f} "
            f"| {r['verify_s']:.3f} | {r['decode_step_s']:.3f} | {r['verify_in_steps']:.1f} "
            f"| {r['refine_in_steps']:.1f} | {r['same_output_as_steps']} |"
        )
    (args.out / "verify_cost.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}/verify_cost.json")


def measure(
    args: argparse.Namespace, flags: list[str], verify_pass: str, prompts: dict[int, str]
) -> list[dict]:
    rows = []
    log_dir = args.out / "logs" / verify_pass
    with Pair(f"verify-{verify_pass}", flags, args, log_dir, ["--disable-overlap-schedule"]) as pair:
        pair.generate("warm up", 2)
        for context, prompt in prompts.items():
            marks = list(range(2, args.cap + args.after + 1))
            # A streamed response carries the transfer report with its first chunk, before
            # verification: read what this request's verify pass did off the server's counters.
            before = speculation_stats(pair)
            last, times = pair.stream(prompt, marks)
            after = speculation_stats(pair)
            delta = {key: after[key] - before[key] for key in COUNTERS}
            committed = 1 + delta["accepted_tokens"] + delta["rejections"]
            tail = [n for n in marks if n > committed + 1]
            step_s = (times[tail[-1]] - times[tail[0]]) / (len(tail) - 1)
            rows.append(
                {
                    "verify_pass": verify_pass,
                    "context": context,
                    "held": delta["held_tokens"],
                    "accepted": delta["accepted_tokens"],
                    "refine_s": delta["refine_seconds"],
                    "verify_s": delta["verify_seconds"],
                    "decode_step_s": step_s,
                    "verify_in_steps": delta["verify_seconds"] / step_s,
                    "refine_in_steps": delta["refine_seconds"] / step_s,
                    "output_ids": last["output_ids"],
                }
            )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "output_ids"}), flush=True)
    return rows


if __name__ == "__main__":
    main()
