"""Codec throughput and size: encode / Anchor-only decode / full decode of one segment of
an SGLang-style KV pool (SmolLM2-135M shape: 30 layers x 3 KV heads x 64, bf16, token
slots scattered over twice as many rows), in GB/s of BF16 input, for the CPU paths (torch
reference; fused C++ with torch's thread count and with one thread) and, when CUDA is
available, the Triton kernels side by side; the speed of each path relative to the torch
reference; bytes per value of each mode, and a SHA-256 over anchor, residual and decoded
rows showing every path wrote the same bytes. Prints a table, writes JSON and a PNG to
benchmark/results/.

    PYTHONPATH=python python benchmark/codec.py --tokens 2048
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from lynx.codec import KVLayout
from lynx.tools.codec_bench import MODES, SMOLLM2_LAYOUT, cpu_backend, make_segment, timed

OPS = ("encode", "decode_anchor", "decode_full")


@dataclass(frozen=True)
class BenchPath:
    name: str
    device: str
    backend: str  # LYNX_CODEC_BACKEND for CPU paths
    threads: int  # torch threads (0: leave as is)


def run_mode(path: BenchPath, name: str, layout: KVLayout, tokens: int, repeats: int) -> dict:
    """One mode on one path: the backend and thread count are set for this run only."""
    threads = torch.get_num_threads()
    torch.set_num_threads(path.threads or threads)
    try:
        with cpu_backend(path.backend):
            return measure(path.name, path.device, name, layout, tokens, repeats)
    finally:
        torch.set_num_threads(threads)


def measure(path: str, device: str, name: str, layout: KVLayout, tokens: int, repeats: int) -> dict:
    segment = make_segment(layout, tokens, MODES[name], device)
    digests = segment.digests()  # the pool now holds the reconstruction
    seconds = {
        "encode": timed(segment.encode, repeats, device),
        "decode_anchor": timed(partial(segment.decode, with_residual=False), repeats, device),
        "decode_full": timed(segment.decode, repeats, device),
    }
    input_bytes = segment.input_nbytes
    values = input_bytes / layout.dtype.itemsize
    return {
        "path": path,
        "threads": torch.get_num_threads(),
        "mode": name,
        **{f"{op}_GBps": input_bytes / s / 1e9 for op, s in seconds.items()},
        "anchor_bits_per_value": 8 * segment.anchor.numel() / values,
        "residual_bits_per_value": 8 * segment.residual.numel() / values,
        "sha256": digests["all"],
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"{r['path']} {r['threads']}t\n{r['mode']}" for r in rows]
    width = 0.27
    for i, op in enumerate(OPS):
        ax1.bar(
            [x + (i - 1) * width for x in range(len(rows))],
            [r[f"{op}_GBps"] for r in rows],
            width,
            label=op,
        )
    ax1.axhline(2.0, color="k", linestyle="--", linewidth=1, label="2 GB/s target")
    ax1.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax1.set_ylabel("GB/s of BF16 input")
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    first = {r["mode"]: r for r in rows}
    modes = list(first)
    anchor = [first[m]["anchor_bits_per_value"] for m in modes]
    ax2.bar(modes, anchor, label="anchor")
    ax2.bar(modes, [first[m]["residual_bits_per_value"] for m in modes], bottom=anchor, label="residual")
    ax2.axhline(16, color="k", linestyle="--", linewidth=1, label="BF16")
    ax2.set_ylabel("bits per value")
    ax2.tick_params(axis="x", rotation=30, labelsize=7)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmark/results/codec")
    args = parser.parse_args()
    layout = SMOLLM2_LAYOUT
    paths = [
        BenchPath("cpu-torch", "cpu", "reference", 0),
        BenchPath("cpu-cpp", "cpu", "cpp", 0),
        BenchPath("cpu-cpp", "cpu", "cpp", 1),
    ]
    if torch.cuda.is_available():
        paths.append(BenchPath("triton", "cuda", "reference", 0))
    rows = []
    for path in paths:
        for name in MODES:
            rows.append(run_mode(path, name, layout, args.tokens, args.repeats))
            print(f"  {path.name:9s} {name:28s} done", flush=True)
    reference = {r["mode"]: r for r in rows if r["path"] == "cpu-torch"}
    print(f"\n{args.tokens}-token segment, {layout}")
    print(
        "| path | threads | mode | encode GB/s | anchor decode GB/s | full decode GB/s | "
        "x torch (enc / anchor / full) | anchor bits/value | residual bits/value | same bytes as torch |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = reference[r["mode"]]
        r["same_as_cpu"] = base["sha256"] == r["sha256"]
        r["ratio_to_torch"] = {op: r[f"{op}_GBps"] / base[f"{op}_GBps"] for op in OPS}
        ratios = " / ".join(f"{r['ratio_to_torch'][op]:.1f}" for op in OPS)
        print(
            f"| {r['path']} | {r['threads']} | {r['mode']} | {r['encode_GBps']:.3f} | "
            f"{r['decode_anchor_GBps']:.3f} | {r['decode_full_GBps']:.3f} | {ratios} | "
            f"{r['anchor_bits_per_value']:.2f} | {r['residual_bits_per_value']:.2f} | "
            f"{r['same_as_cpu']} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "tokens": args.tokens,
                "layout": str(layout),
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
