"""Does upstream SGLang pick the same greedy token in an extend pass as in a decode step?

Speculative mode verifies held tokens with ONE extend forward, while ``full`` mode picks
every token with a decode step. Both read the same KV, but the kernels see different
shapes, so the logits differ in their last bits; where two candidates tie (bf16 logits
have 8 significant bits), the argmax can flip. This measures how often that happens in
upstream alone, without Lynx: one plain server greedily decodes ``--gen`` tokens from
each real prompt (with the top-2 logprobs), then for every position ``j`` a fresh request
prefills ``prompt + output[:j]`` and takes one token: the extend path's choice at that
position, teacher-forced on the decode path's tokens.

Prints each flip with its top-2 logprob gap (as the decode step saw it), a summary line,
and writes JSON to ``--out``.

    PYTHONPATH=python .venv/bin/python benchmark/extend_vs_decode.py
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_texts import benchmark_parser
from pd_transfer import prompts_from
from transformers import AutoTokenizer

from lynx.tools.cluster import ServerConfig, SingleServer, http_json

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--fp32-lm-head", action="store_true", help="serve with --enable-fp32-lm-head")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/extend_vs_decode")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = prompts_from(args.data, tokenizer, args.prompts, args.prompt_tokens, skip=1000)
    extra = ["--disable-radix-cache", "--chunked-prefill-size", "4096"]
    if args.fp32_lm_head:
        extra.append("--enable-fp32-lm-head")
    config = ServerConfig(model_path=args.model, max_total_tokens=16384, extra_args=extra)
    flips, positions, ties = [], 0, 0
    with SingleServer(config, args.out / "logs", name="single") as server:
        for i, prompt in enumerate(prompts):
            ids = tokenizer(prompt).input_ids
            params = {"max_new_tokens": args.gen, "temperature": 0, "ignore_eos": True}
            body = {
                "input_ids": ids,
                "sampling_params": params,
                "return_logprob": True,
                "top_logprobs_num": 2,
            }
            answer = http_json(server.url + "/generate", body)
            output, tops = answer["output_ids"], answer["meta_info"]["output_top_logprobs"]
            for j in range(1, len(output)):
                gap = tops[j][0][0] - tops[j][1][0]
                ties += gap == 0.0
                one = {"max_new_tokens": 1, "temperature": 0}
                extend = http_json(
                    server.url + "/generate", {"input_ids": ids + output[:j], "sampling_params": one}
                )
                positions += 1
                if extend["output_ids"][0] != output[j]:
                    flips.append({"prompt": i, "position": j, "top2_logprob_gap": gap})
                    print(
                        f"prompt {i} position {j}: extend and decode disagree (top-2 gap {gap:.4f})",
                        flush=True,
                    )
    summary = {
        "model": str(args.model),
        "fp32_lm_head": args.fp32_lm_head,
        "positions": positions,
        "flips": len(flips),
        "exact_ties_seen_by_decode": ties,
        "flips_at_exact_ties": sum(1 for f in flips if f["top2_logprob_gap"] == 0.0),
        "detail": flips,
    }
    print(
        f"\n{positions} teacher-forced positions, {len(flips)} where extend and decode pick different "
        f"tokens ({summary['flips_at_exact_ties']} of them at an exact top-2 tie); "
        f"{ties} exact ties seen by the decode steps"
    )
    (args.out / "extend_vs_decode.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out}/extend_vs_decode.json")


if __name__ == "__main__":
    main()
