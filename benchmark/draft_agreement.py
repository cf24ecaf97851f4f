"""Why drafts decoded on the Anchor are rejected more often in BF16 arithmetic than in the
FP32 proxy: an offline model of one speculation window, no servers (issue #25, item 3).

For each prompt (``--prompts`` real texts, ``--tokens`` tokens each) and each arithmetic
of ``--arithmetics``:

* ``fp32``: FP32 arithmetic over a BF16 KV cache (the proxy the servers run where BF16
  is slow);
* ``bf16``: BF16 arithmetic, BF16 logits (what SGLang computes by default in a BF16
  deployment: its lm_head multiplies in BF16);
* ``bf16+fp32-logits``: BF16 arithmetic, the last hidden state multiplied by the lm_head
  in FP32 (upstream's ``--enable-fp32-lm-head``): whether the logits' rounding is the cause;

prefill the prompt in that arithmetic, keep its KV as a BF16 pool holds it, and decode
``--gen`` tokens greedily after prefill's first token, one per step, twice: from that KV
(the reference: what a verification commits) and from its Anchor-only reconstruction (the draft), for each
``--bits`` x ``--protect-last`` (the last N prompt tokens at full precision, as
``--lynx-protect-last`` sends them). The accepted run is the draft's tokens before its
first difference from the reference, as one verification of ``--gen`` held tokens judges
them. At that first difference the reference's own top-1 - top-2 logit gap is recorded
in units of the BF16 unit in the last place (ulp) of its top logit: 0 is an exact tie the
arithmetic made, 1 the smallest gap BF16 logits can show.

Transformers' kernels, not SGLang's: a model of the cause, not the servers' figure (those
come from ``spec_acceptance.py`` and ``suite.py``). Prints a table; writes JSON.

    PYTHONPATH=python:benchmark .venv/bin/python benchmark/draft_agreement.py --prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bench_texts import MODEL_DIR, TEXTS, fetch_texts
from codec_accuracy import SKIP_TOKENS, make_cache
from transformers import AutoModelForCausalLM, AutoTokenizer

from lynx.codec import CodecConfig, decode, encode
from lynx.verify import bf16_ulp

ROOT = Path(__file__).resolve().parents[1]
ARITHMETICS = ("fp32", "bf16", "bf16+fp32-logits")


@dataclass(frozen=True)
class Draft:
    """How the draft's KV is made: an Anchor of ``bits`` with the last ``protect_last``
    prompt tokens at full precision."""

    bits: int
    protect_last: int

    @property
    def name(self) -> str:
        return f"{self.bits}-bit, protect last {self.protect_last}"


class Decoder:
    """A causal LM in one arithmetic, decoding greedily one token per step."""

    def __init__(self, model_dir: Path, arithmetic: str) -> None:
        self.dtype = torch.float32 if arithmetic == "fp32" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).eval()
        self.fp32_logits = arithmetic == "bf16+fp32-logits"
        self.lm_head = self.model.get_output_embeddings().weight.float() if self.fp32_logits else None

    @torch.no_grad()
    def forward(self, ids: list[int], cache: Any) -> torch.Tensor:
        """The last position's logits after feeding ``ids`` on ``cache`` (an FP32 copy)."""
        if self.lm_head is None:
            return self.model(torch.tensor([ids]), past_key_values=cache).logits[0, -1].float()
        hidden = self.model.model(torch.tensor([ids]), past_key_values=cache).last_hidden_state
        return hidden[0, -1].float() @ self.lm_head.T

    def prefill(self, ids: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """The prompt's per-layer (tokens, heads, head_dim) K and V, in BF16 as a pool
        holds them, and the first token (prefill's, never held)."""
        cache = make_cache([], self.dtype)
        first = int(self.forward(ids, cache).argmax())
        kv = [
            (
                layer.keys[0].permute(1, 0, 2).to(torch.bfloat16),
                layer.values[0].permute(1, 0, 2).to(torch.bfloat16),
            )
            for layer in cache.layers
        ]
        return kv, first

    def greedy(
        self, kv: list[tuple[torch.Tensor, torch.Tensor]], first: int, steps: int
    ) -> tuple[list[int], list[torch.Tensor]]:
        """``steps`` greedy tokens after the prompt whose KV is ``kv`` and its first token
        ``first``, and the logits each was chosen from."""
        cache = make_cache(kv, self.dtype)
        tokens, logits = [first], []
        for _ in range(steps):
            row = self.forward([tokens[-1]], cache)
            logits.append(row)
            tokens.append(int(row.argmax()))
        return tokens[1:], logits


def anchor_only(
    kv: list[tuple[torch.Tensor, torch.Tensor]], draft: Draft
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``kv`` as decode holds it between the Anchor and the Residual."""
    config = CodecConfig(anchor_bits=draft.bits)
    out = []
    for k, v in kv:
        pair = []
        for x, kind in ((k, "key"), (v, "value")):
            y = decode(
                encode(x, config, kind=kind).anchor,
                None,
                config=config,
                shape=x.shape,
                dtype=x.dtype,
                kind=kind,
            )
            if draft.protect_last:
                y[-draft.protect_last :] = x[-draft.protect_last :]
            pair.append(y)
        out.append((pair[0], pair[1]))
    return out


def judge(reference: list[int], ref_logits: list[torch.Tensor], drafted: list[int]) -> dict[str, Any]:
    """One verification of ``drafted`` against ``reference``: the accepted run and, at the
    first difference, the reference's top-2 gap in BF16 ulps of its top logit."""
    accepted = next(
        (i for i, (r, d) in enumerate(zip(reference, drafted, strict=True)) if r != d), len(reference)
    )
    if accepted == len(reference):
        return {"accepted": accepted, "gap_ulps": None}
    top = torch.topk(ref_logits[accepted], 2).values.tolist()
    return {"accepted": accepted, "gap_ulps": (top[0] - top[1]) / bf16_ulp(top[0])}


def summarize(judged: list[dict[str, Any]], window: int) -> dict[str, Any]:
    gaps = [j["gap_ulps"] for j in judged if j["gap_ulps"] is not None]
    return {
        "acceptance": sum(j["accepted"] for j in judged) / (window * len(judged)),
        "median_run": statistics.median(j["accepted"] for j in judged),
        "full_windows": sum(1 for j in judged if j["gap_ulps"] is None),
        "misses": len(gaps),
        "misses_at_gap_0": sum(1 for g in gaps if g == 0),
        "misses_at_gap_le_1": sum(1 for g in gaps if g <= 1),
        "misses_at_gap_gt_4": sum(1 for g in gaps if g > 4),
        "gaps_ulps": gaps,
        "runs": [j["accepted"] for j in judged],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--data", type=Path, default=Path("/tmp/lynxdata"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--gen", type=int, default=32, help="held tokens per window")
    parser.add_argument("--arithmetics", nargs="+", choices=ARITHMETICS, default=list(ARITHMETICS))
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3])
    parser.add_argument("--protect-last", type=int, nargs="+", default=[0, 64, 256])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/draft_agreement")
    args = parser.parse_args()
    fetch_texts(args.data)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = []
    for name in (TEXTS * args.prompts)[: args.prompts]:
        ids = tokenizer((args.data / name).read_text(errors="replace"))["input_ids"]
        offset = SKIP_TOKENS + len(prompts) * args.tokens  # the same text twice: other passages
        prompts.append(ids[offset : offset + args.tokens])
        if len(prompts[-1]) != args.tokens:
            raise SystemExit(f"{name} has fewer than {offset + args.tokens} tokens")
    drafts = [Draft(b, p) for b in args.bits for p in args.protect_last]
    judged: dict[str, dict[str, list[dict[str, Any]]]] = {}
    started = time.perf_counter()
    for arithmetic in args.arithmetics:
        decoder = Decoder(args.model, arithmetic)
        judged[arithmetic] = {d.name: [] for d in drafts}
        for index, ids in enumerate(prompts):
            kv, first = decoder.prefill(ids)
            reference, ref_logits = decoder.greedy(kv, first, args.gen)
            for draft in drafts:
                drafted, _ = decoder.greedy(anchor_only(kv, draft), first, args.gen)
                judged[arithmetic][draft.name].append(judge(reference, ref_logits, drafted))
            print(f"{arithmetic} prompt {index}: {time.perf_counter() - started:.0f} s", flush=True)
    table = {a: {d: summarize(j, args.gen) for d, j in per.items()} for a, per in judged.items()}
    print(f"\n{args.model.name}, {len(prompts)} prompts of {args.tokens} tokens, windows of {args.gen}")
    print("| arithmetic | draft | acceptance | median run | full windows | misses: gap 0 / <=1 / >4 ulps |")
    print("|---|---|---:|---:|---:|---|")
    for arithmetic, rows in table.items():
        for name, row in rows.items():
            print(
                f"| {arithmetic} | {name} | {100 * row['acceptance']:.0f}% | {row['median_run']:g} | "
                f"{row['full_windows']}/{len(prompts)} | {row['misses_at_gap_0']} / "
                f"{row['misses_at_gap_le_1']} / {row['misses_at_gap_gt_4']} of {row['misses']} |"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.model.name}.json"
    plan = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path.write_text(
        json.dumps({"plan": plan, "seconds": time.perf_counter() - started, "table": table}, indent=1)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
