"""How many tokens decoded on the Anchor survive verification, why the rest do not, and
how far the committed output is from plain BF16 PD, per Anchor width and verify tolerance.

For each ``--bits`` x ``--tolerances`` pair a real speculative prefill + decode pair
(loopback) serves ``--prompts`` greedy requests of ``--prompt-tokens`` tokens of real
text, ``--gen`` new tokens each, all at once. The Residual is held back ``--hold``
seconds on prefill (``--lynx-residual-hold``), long enough for every request to decode
``--cap`` tokens on Anchor KV before verification, so each verification judges a full
run of held tokens. A plain BF16 PD pair (and with ``--with-full`` Lynx ``full`` mode)
serves the same prompts as the reference. From each response's
``meta_info["lynx_transfer"][-1]["speculation"]``:

* acceptance: accepted / held tokens (the accepted prefix of each run: after the first
  wrong token the rest is discarded whether or not it was right);
* agreement: held tokens equal to the full-precision argmax at their position, given the
  held tokens before them (teacher-forced on the draft);
* rejections by the rejected token's log-probability gap to the best one: an exact tie,
  a near-tie (at most one BF16 ulp of the best logit: a tie BF16 logits cannot resolve)
  or a real miss (more), and
  the real misses as a share of held positions;
* vs BF16: the share of the greedy outputs identical to plain BF16 PD's, and of the tokens
  before the first difference.

Prints a table; writes JSON and a PNG to ``--out``.

    PYTHONPATH=python .venv/bin/python benchmark/spec_acceptance.py --bits 2 3 4
    PYTHONPATH=python .venv/bin/python benchmark/spec_acceptance.py --bits 4 --tolerances 0 0.03 0.125 \\
        --with-full --model ~/.cache/lynx/models/Qwen2.5-Coder-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from bench_texts import benchmark_parser
from pd_transfer import TEXTS, Pair, agreement_of, prompts_from
from transformers import AutoTokenizer

from lynx.codec import CodecConfig, KVLayout
from lynx.mode import Mode
from lynx.transfer import Handshake, RequestLayout
from lynx.transfer.protocol import protection_cost
from lynx.verify import NEAR_TIE_GAP, NEAR_TIE_ULPS

ROOT = Path(__file__).resolve().parents[1]


def protect_pair(text: str) -> tuple[int, int]:
    first, last = text.split(":")
    return int(first), int(last)


def extra_config(text: str) -> tuple[int, float, tuple[int, int]]:
    bits, tolerance, first, last = text.split(":")
    return int(bits), float(tolerance), (int(first), int(last))


def serve(
    name: str, flags: list[str], prompts: list[str], args: argparse.Namespace, *, at_once: bool
) -> list[dict]:
    """Each prompt's answer from a fresh pair; ``at_once``: all requests concurrently (the
    speculative runs, whose Residual is held back anyway), else one after the other."""
    with Pair(name, flags, args, args.out / "logs") as pair:
        pair.generate("warm up", 2)
        with ThreadPoolExecutor(len(prompts) if at_once else 1) as pool:
            return list(pool.map(lambda p: pair.generate(p, args.gen)[0], prompts))


def speculative_flags(
    bits: int, tolerance: float, protect: tuple[int, int], args: argparse.Namespace
) -> list[str]:
    return [
        "--lynx-protect-first",
        str(protect[0]),
        "--lynx-protect-last",
        str(protect[1]),
        "--lynx",
        "--lynx-mode",
        "speculative",
        "--lynx-anchor-bits",
        str(bits),
        "--lynx-verify-tolerance",
        str(tolerance),
        "--lynx-verify-pass",
        args.verify_pass,
        "--lynx-max-speculative-tokens",
        str(args.cap),
        "--lynx-residual-hold",
        str(args.hold),
        "--lynx-transfer-deadline",
        str(args.hold * 4 + 60),
    ]


def summarize(answers: list[dict], reference: list[list[int]]) -> dict[str, Any]:
    reports = [a["meta_info"]["lynx_transfer"][-1].get("speculation") or {} for a in answers]
    held = sum(r.get("held", 0) for r in reports)
    accepted = sum(r.get("accepted", 0) for r in reports)
    agreed = sum(r.get("agreed") or 0 for r in reports)
    # in BF16 ulps of the best logit where the report has them (NEAR_TIE_GAP is one ulp
    # only for logits of 16-32)
    gaps = [
        (r["rejection_gap_ulps"], NEAR_TIE_ULPS)
        if r.get("rejection_gap_ulps") is not None
        else (r["rejection_gap"], NEAR_TIE_GAP)
        for r in reports
        if r.get("rejection_gap") is not None
    ]
    far = sum(1 for g, near in gaps if g > near)
    outputs = [a["output_ids"] for a in answers]
    return {
        "requests": len(reports),
        "held": held,
        "accepted": accepted,
        "acceptance": accepted / held if held else None,
        "agreement": agreed / held if held else None,
        "fully_accepted": sum(1 for r in reports if r.get("held") and not r.get("rejected")) / len(reports),
        "rejections": {
            "tie": sum(1 for g, _ in gaps if g == 0.0),
            "near_tie": sum(1 for g, near in gaps if 0.0 < g <= near),
            "far": far,
        },
        "far_rejections_per_held": far / held if held else None,
        "vs_bf16": agreement_of(outputs, reference),
        "reports": reports,
        "outputs": outputs,
    }


def model_kv_layout(model: Path, dtype: str) -> KVLayout:
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    return KVLayout(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads), head_dim, kv_dtype)


def plot(rows: list[dict], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    labels = [f"{r['bits']}b p{r['protect'][0]}:{r['protect'][1]} T={r['tolerance']:g}" for r in rows]
    ax.bar(labels, [100 * (r["acceptance"] or 0) for r in rows], label="acceptance")
    ax.plot(labels, [100 * (r["agreement"] or 0) for r in rows], "o", color="k", label="per-token agreement")
    ax.set_ylabel("held tokens (%)")
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right")
    ax.set_title(f"Speculative acceptance, {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--tolerances", type=float, nargs="+", default=[0.0])
    parser.add_argument(
        "--protect", type=protect_pair, nargs="+", default=[(0, 0)], help="protected FIRST:LAST token counts"
    )
    parser.add_argument(
        "--extra", type=extra_config, nargs="*", help="more BITS:TOLERANCE:FIRST:LAST configurations"
    )
    parser.add_argument("--with-full", action="store_true", help="also serve Lynx full mode")
    parser.add_argument("--verify-pass", choices=["steps", "batched"], default="steps")
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="serve speculative requests one at a time, as the reference: the same decode batch "
        "sizes, so outputs can equal the reference bit for bit (otherwise all at once)",
    )
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
    layout = model_kv_layout(args.model, args.dtype)
    print("== plain BF16 PD (reference)", flush=True)
    reference = [a["output_ids"] for a in serve("bf16", [], prompts, args, at_once=False)]
    full = None
    if args.with_full:
        print("== Lynx full", flush=True)
        full = agreement_of(
            [a["output_ids"] for a in serve("full", ["--lynx"], prompts, args, at_once=False)], reference
        )
    rows = []
    configs = [(b, t, p) for b in args.bits for p in args.protect for t in args.tolerances]
    configs += [c for c in args.extra or [] if c not in configs]
    for bits, tolerance, protect in configs:
        print(f"== {bits}-bit Anchors, tolerance {tolerance}, protect {protect}", flush=True)
        flags = speculative_flags(bits, tolerance, protect, args)
        name = f"spec-{bits}bit-t{tolerance}-p{protect[0]}-{protect[1]}"
        answers = serve(name, flags, prompts, args, at_once=not args.one_at_a_time)
        handshake = Handshake(
            Mode.SPECULATIVE,
            CodecConfig(anchor_bits=bits),
            layout,
            protect_first=protect[0],
            protect_last=protect[1],
        )
        rows.append(
            {
                "bits": bits,
                "tolerance": tolerance,
                "protect": list(protect),
                "protected_tokens": RequestLayout.of(handshake, args.prompt_tokens).protected_tokens,
                "anchor_bytes_added": protection_cost(handshake, args.prompt_tokens)[0],
                **summarize(answers, reference),
            }
        )
        r = rows[-1]
        print(f"  acceptance {r['acceptance']}, agreement {r['agreement']}, {r['rejections']}", flush=True)
    print(
        f"\n{args.model.name} ({args.dtype}): {args.prompts} prompts x {args.prompt_tokens} tokens "
        f"of {len(TEXTS)} texts, gen {args.gen}, cap {args.cap}, Residual held {args.hold} s, "
        f"verify pass {args.verify_pass}, {'one at a time' if args.one_at_a_time else 'all at once'}"
    )
    print(
        "| anchor bits | protect first:last (tokens) | Anchor bytes added | tolerance | held | acceptance "
        "| per-token agreement | fully accepted | rejections tie / near / far | far per held "
        "| = BF16 outputs | tokens before 1st diff |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        rej, vs, far = r["rejections"], r["vs_bf16"], r["far_rejections_per_held"] or 0
        first, last = r["protect"]
        print(
            f"| {r['bits']} | {first}:{last} ({r['protected_tokens']}) | {r['anchor_bytes_added']} "
            f"| {r['tolerance']:g} | {r['held']} | {100 * (r['acceptance'] or 0):.1f}% "
            f"| {100 * (r['agreement'] or 0):.1f}% | {100 * r['fully_accepted']:.0f}% "
            f"| {rej['tie']} / {rej['near_tie']} / {rej['far']} | {100 * far:.2f}% "
            f"| {100 * vs['identical_outputs']:.0f}% | {100 * vs['tokens_before_first_difference']:.1f}% |"
        )
    if full is not None:
        print(
            f"| full | | | | | | | | | | {100 * full['identical_outputs']:.0f}% "
            f"| {100 * full['tokens_before_first_difference']:.1f}% |"
        )
    (args.out / "spec_acceptance.json").write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "reference": reference,
                "full": full,
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, args.out / "spec_acceptance.png", args.model.name)
    print(f"wrote {args.out}/spec_acceptance.json and spec_acceptance.png")


if __name__ == "__main__":
    main()
