"""The lossless Residual on real KV: bytes against plain BF16/FP16 and against the entropy
of its own model, and the C++ codec's speed, side by side with the INT8 Residual.

For each model (SmolLM2-135M, Qwen2.5-Coder-0.5B; transformers, FP32 arithmetic on the
CPU) the KV of tokens 1000..1000+N of a public text (Python's ``functions.rst``), every
layer, cast to BF16 and to FP16 as a pool would hold it, is encoded per layer and kind
(keys per channel, values per token) and decoded back:

* ``ratio``: (Anchor + Residual bytes) / plain bytes, keys and values apart and together,
  for the lossless (``exact``) and the INT8 Residual; every lossless decode is checked
  bit for bit against the input;
* ``model bound``: the Anchor plus the empirical conditional entropy of the lossless
  code's symbols given their contexts plus its raw bits: what an ideal entropy coder
  would reach with the same model (the Huffman codes and their tables cost the rest);
* ``index bound``: the Anchor plus the empirical entropy of each value's distance from
  its Anchor-only word given the number of words its anchor step spans there (about the
  bound named in the issue; a richer model than the code's). Empirical entropies are
  Miller-Madow corrected, and still optimistic where contexts are many and sparse (the
  index bound of FP16, whose spans run to thousands of words);
* speed: ``encode_pages`` / ``decode_pages`` of 256-token segments (the transfer's) of the
  BF16 KV, rows scattered over a pool, in GB/s of BF16 input, with torch's thread count,
  after one untimed segment (a server's codec is warm);
  and the link rate above which the codec, not the link, would set the pace (the encoded
  bytes per second it produces or consumes).

    PYTHONPATH=python:benchmark python benchmark/codec_lossless.py --tokens 1024

Prints a table, writes JSON and a PNG (``--out``, default benchmark/results/codec_lossless).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from bench_texts import TEXTS, fetch_texts
from transformers import AutoModelForCausalLM, AutoTokenizer

from lynx.codec import (
    CodecConfig,
    KVLayout,
    decode,
    decode_pages,
    encode,
    encode_pages,
    lossless,
    reference,
    segment_nbytes,
)
from lynx.codec.format import part_layout
from lynx.tools import models as lynx_models

SKIP_TOKENS = 1000
SEGMENT_TOKENS = 256
MODELS = {"smollm2": lynx_models.prepare_smollm2, "qwen2.5-coder-0.5b": lynx_models.prepare_qwen25_coder}
KINDS = ("key", "value")


def real_kv(model_dir: Path, text: Path, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of shape (tokens, kv_heads, head_dim), FP32."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(text.read_text(errors="replace"))["input_ids"][SKIP_TOKENS : SKIP_TOKENS + tokens]
    if len(ids) != tokens:
        raise SystemExit(f"{text} has fewer than {SKIP_TOKENS + tokens} tokens")
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    return [
        (layer.keys[0].permute(1, 0, 2).contiguous(), layer.values[0].permute(1, 0, 2).contiguous())
        for layer in out.past_key_values.layers
    ]


def conditional_entropy_bits(context: torch.Tensor, symbol: torch.Tensor) -> float:
    """Sum over values of -log2 p(symbol | context), p the empirical frequencies, plus the
    Miller-Madow correction ((symbols seen - 1) / (2 ln 2) bits per context): the plain
    empirical entropy of a context with few values and many symbols is far too low."""
    _, group = torch.unique(context.reshape(-1), return_inverse=True)
    width = int(symbol.max()) + 1
    pairs, counts = torch.unique(group * width + symbol.reshape(-1), return_counts=True)
    totals = torch.bincount(group).double()
    counts = counts.double()
    seen = torch.bincount(pairs // width, minlength=totals.numel()).double()
    correction = float((seen - 1).clamp(min=0).sum()) / (2 * math.log(2))
    return float(-(counts * torch.log2(counts / totals[pairs // width])).sum()) + correction


def part_bounds(x: torch.Tensor, kind: str, config: CodecConfig) -> tuple[float, float]:
    """(model bound, index bound) of one part's lossless Residual, in bytes."""
    n, channels = x.shape[0], x[0].numel()
    fmt = lossless.word_format(x.dtype)
    enc = encode(x, config, kind=kind)  # type: ignore[arg-type]
    layout = part_layout(n, channels, kind, config, x.dtype)  # type: ignore[arg-type]
    scales = reference.params(enc.anchor, layout, layout.scales_offset, x.dtype)
    anchor = decode(enc.anchor, None, config=config, shape=(n, channels), dtype=x.dtype, kind=kind)  # type: ignore[arg-type]
    scale_values = reference.value_scales(scales, n, channels, kind, config)  # type: ignore[arg-type]
    words, anchor_words = lossless.unsigned_words(x.reshape(n, channels)), lossless.unsigned_words(anchor)
    d = lossless.ordinals(words, fmt) - lossless.ordinals(anchor_words, fmt)
    z = torch.where(d >= 0, 2 * d, -2 * d - 1)
    s = lossless.bit_lengths(z)
    c = lossless.contexts(anchor_words, lossless.unsigned_words(scale_values), fmt)
    model = conditional_entropy_bits(c, s) + float((s - 1).clamp(min=0).sum())
    # words within half an anchor step of the Anchor-only value: the step's span in words
    half = scale_values.double() / 2
    low = (anchor.double() - half).to(x.dtype)
    high = (anchor.double() + half).to(x.dtype)
    span = lossless.ordinals(lossless.unsigned_words(high), fmt) - lossless.ordinals(
        lossless.unsigned_words(low), fmt
    )
    index = conditional_entropy_bits(span.clamp(min=0, max=1 << 12), z)
    return model / 8, index / 8


def ratios(kv: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> dict:
    """Bytes of every configuration, per kind, against the plain words."""
    exact, int8 = CodecConfig(residual="exact"), CodecConfig(residual="int8")
    totals = {
        kind: {"plain": 0, "anchor": 0, "exact": 0, "int8": 0, "model": 0.0, "index": 0.0} for kind in KINDS
    }
    for layer in kv:
        for kind, x32 in zip(KINDS, layer, strict=True):
            x = x32.to(dtype)
            t = totals[kind]
            enc = encode(x, exact, kind=kind)  # type: ignore[arg-type]
            back = decode(enc.anchor, enc.residual, config=exact, shape=x.shape, dtype=dtype, kind=kind)  # type: ignore[arg-type]
            if not torch.equal(back.view(torch.uint8), x.view(torch.uint8)):
                raise SystemExit(f"the lossless Residual did not decode bit for bit ({dtype}, {kind}s)")
            t["plain"] += x.numel() * x.element_size()
            t["anchor"] += enc.anchor.numel()
            t["exact"] += enc.residual.numel()
            t["int8"] += encode(x, int8, kind=kind).residual.numel()  # type: ignore[arg-type]
            model, index = part_bounds(x, kind, exact)
            t["model"] += model
            t["index"] += index
    out: dict = {}
    for name, kinds in (("keys", ["key"]), ("values", ["value"]), ("keys+values", list(KINDS))):
        plain = sum(totals[k]["plain"] for k in kinds)
        anchor = sum(totals[k]["anchor"] for k in kinds)
        out[name] = {
            "exact": (anchor + sum(totals[k]["exact"] for k in kinds)) / plain,
            "model_bound": (anchor + sum(totals[k]["model"] for k in kinds)) / plain,
            "index_bound": (anchor + sum(totals[k]["index"] for k in kinds)) / plain,
            "int8": (anchor + sum(totals[k]["int8"] for k in kinds)) / plain,
            "anchor": anchor / plain,
        }
    return out


def speed(kv: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> dict:
    """GB/s of BF16 input of encode_pages / decode_pages over 256-token segments."""
    tokens = kv[0][0].shape[0]
    heads, head_dim = kv[0][0].shape[1:]
    rows = 2 * tokens
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(rows, generator=gen)[:tokens]
    pool_k = [torch.zeros(rows, heads, head_dim, dtype=torch.bfloat16) for _ in kv]
    pool_v = [torch.zeros(rows, heads, head_dim, dtype=torch.bfloat16) for _ in kv]
    for (k, v), pk, pv in zip(kv, pool_k, pool_v, strict=True):
        pk[slots], pv[slots] = k.to(torch.bfloat16), v.to(torch.bfloat16)
    out_k = [torch.zeros_like(b) for b in pool_k]
    out_v = [torch.zeros_like(b) for b in pool_v]
    layout = KVLayout(len(kv), heads, head_dim, torch.bfloat16)
    result = {}
    for residual in ("exact", "int8"):
        config = CodecConfig(residual=residual)  # type: ignore[arg-type]
        anchor_n, residual_n = segment_nbytes(layout, SEGMENT_TOKENS, config)
        anchor = torch.empty(anchor_n, dtype=torch.uint8)
        space = torch.empty(residual_n, dtype=torch.uint8)
        encode_s = decode_s = 0.0
        wire = values = 0
        warm = slots[:SEGMENT_TOKENS].contiguous()  # untimed: a server's codec is warm
        encode_pages(pool_k, pool_v, warm, config, anchor, space)
        decode_pages(anchor, space, out_k, out_v, warm, config)
        for _ in range(repeats):
            for start in range(0, tokens - SEGMENT_TOKENS + 1, SEGMENT_TOKENS):
                seg = slots[start : start + SEGMENT_TOKENS].contiguous()
                began = time.perf_counter()
                used = encode_pages(pool_k, pool_v, seg, config, anchor, space)
                encode_s += time.perf_counter() - began
                began = time.perf_counter()
                decode_pages(anchor, space, out_k, out_v, seg, config)
                decode_s += time.perf_counter() - began
                wire += anchor_n + used
                values += 2 * len(kv) * SEGMENT_TOKENS * heads * head_dim
        if residual == "exact" and not all(
            torch.equal(a[slots].view(torch.int16), b[slots].view(torch.int16))
            for a, b in zip(pool_k + pool_v, out_k + out_v, strict=True)
        ):
            raise SystemExit("encode_pages/decode_pages of the lossless Residual are not bit-exact")
        nbytes = 2 * values
        result[residual] = {
            "encode_gbps": nbytes / encode_s / 1e9,
            "decode_gbps": nbytes / decode_s / 1e9,
            "wire_ratio": wire / nbytes,
            # the link rate (Gbit/s of encoded bytes) above which the codec sets the pace
            "encode_bound_gbit": 8 * wire / encode_s / 1e9,
            "decode_bound_gbit": 8 * wire / decode_s / 1e9,
        }
    return result


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels, bars = [], {"index_bound": [], "model_bound": [], "exact": [], "int8": []}
    for model, per_dtype in results["ratios"].items():
        for dtype, kinds in per_dtype.items():
            for kind in ("keys", "values", "keys+values"):
                labels.append(f"{model}\n{dtype} {kind}")
                for name in bars:
                    bars[name].append(kinds[kind][name])
    width = 0.2
    for i, (name, values) in enumerate(bars.items()):
        ax.bar([x + (i - 1.5) * width for x in range(len(labels))], values, width, label=name)
    ax.axhline(0.78, color="black", linewidth=0.8, linestyle="--", label="0.78 target")
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set_ylabel("(Anchor + Residual) / plain bytes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", type=Path, default=Path("/tmp/lynxdata"))
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/codec_lossless"))
    args = parser.parse_args()
    fetch_texts(args.data)
    results: dict = {
        "command": "benchmark/codec_lossless.py "
        + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
        ),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "date": time.strftime("%Y-%m-%d"),
        "ratios": {},
        "speed": {},
    }
    for name in args.models:
        kv = real_kv(MODELS[name](), args.data / TEXTS[0], args.tokens)
        results["ratios"][name] = {
            str(d).removeprefix("torch."): ratios(kv, d) for d in (torch.bfloat16, torch.float16)
        }
        results["speed"][name] = speed(kv, args.repeats)
    print(
        "(Anchor + Residual) / plain bytes; bounds: ideal coders of the code's model / "
        "of the index given its span"
    )
    print(
        f"{'model':20s} {'dtype':9s} {'kind':12s} {'exact':>7s} {'model':>7s} {'index':>7s} "
        f"{'int8':>7s} {'anchor':>7s}"
    )
    for model, per_dtype in results["ratios"].items():
        for dtype, kinds in per_dtype.items():
            for kind, r in kinds.items():
                print(
                    f"{model:20s} {dtype:9s} {kind:12s} {r['exact']:7.3f} {r['model_bound']:7.3f} "
                    f"{r['index_bound']:7.3f} {r['int8']:7.3f} {r['anchor']:7.3f}"
                )
    print(f"\nspeed, GB/s of BF16 input ({torch.get_num_threads()} threads, 256-token segments)")
    for model, modes in results["speed"].items():
        for mode, r in modes.items():
            print(
                f"{model:20s} {mode:6s} encode {r['encode_gbps']:.2f} decode {r['decode_gbps']:.2f} "
                f"(codec paces links above {min(r['encode_bound_gbit'], r['decode_bound_gbit']):.2f} Gbit/s)"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "codec_lossless.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "codec_lossless.png")
    print(f"wrote {args.out}/codec_lossless.json and .png")


if __name__ == "__main__":
    main()
