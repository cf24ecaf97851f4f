"""What the per-segment checksums (``lynx.transfer.protocol.span_checksum``, the
``checksums`` setting) cost: prefill encodes a request segment by segment and checksums
the new segments' ranges after each chunk (as ``ProgressiveSender`` does; here the request
is one chunk); decode checks every range before decoding (as
``ProgressiveReceiver.write_kv`` does). Times encode alone vs encode + checksums, and
decode (Anchor + Residual) alone vs check + decode, for one request on an SGLang-style KV
pool (default: SmolLM2-135M's shape, 30 layers x 3 KV heads x 64, bf16, 4096 tokens,
rows scattered over twice as many). Each figure is the fastest of ``--repeats`` runs,
the variants interleaved so that a busy host slows them alike.

    PYTHONPATH=python python benchmark/checksum_cost.py --tokens 4096 --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lynx.codec import CodecConfig, KVLayout, decode_pages, encode_pages
from lynx.mode import Mode
from lynx.transfer.protocol import RequestLayout, Stream, checksum_values, span_checksum


def kv_parser(doc: str | None, repeats: int) -> argparse.ArgumentParser:
    """The options of a synthetic request on an SGLang-style KV pool (:func:`synthetic_kv`)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--residual", choices=["int8", "exact"], default="int8")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser


def synthetic_kv(
    args: argparse.Namespace,
) -> tuple[KVLayout, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """BF16 keys and values of ``args.layers`` layers over a pool of twice ``args.tokens``
    rows, and the request's ``args.tokens`` slots scattered over it; sets torch's threads."""
    torch.set_num_threads(args.threads)
    layout = KVLayout(args.layers, args.heads, args.head_dim, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    rows = 2 * args.tokens
    shape = (rows, args.heads, args.head_dim)
    k = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(args.layers)]
    v = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(args.layers)]
    slots = torch.randperm(rows, generator=gen)[: args.tokens]
    return layout, k, v, slots


def main() -> None:
    args = kv_parser(__doc__, repeats=9).parse_args()
    layout, k, v, slots = synthetic_kv(args)
    config = CodecConfig(residual=args.residual)
    plan = RequestLayout(layout, config, args.tokens, Mode.FULL)
    out_k = [torch.zeros_like(t) for t in k]
    out_v = [torch.zeros_like(t) for t in v]
    space = torch.zeros(plan.encoded_nbytes, dtype=torch.uint8)

    def encode(checksum: bool) -> None:
        for seg in plan.segments:
            anchor, residual = plan.byte_ranges(seg)
            encode_pages(k, v, slots[seg.start : seg.end], config, space[anchor], space[residual])
        if checksum:  # as the sender does after each chunk (here: the request in one chunk)
            checksum_values(
                [span_checksum(space[span]) for seg in plan.segments for _, span in plan.sent_ranges(seg)]
            )

    def decode(sums: bool) -> None:
        if sums:
            for stream in plan.streams:
                checksum_values([span_checksum(space[span]) for _, span in plan.stream_ranges(stream)])
        for seg in plan.segments:
            anchor, residual = plan.byte_ranges(seg)
            decode_pages(space[anchor], space[residual], out_k, out_v, slots[seg.start : seg.end], config)

    variants: dict[str, Callable[[], None]] = {
        "encode": lambda: encode(False),
        "encode + checksums": lambda: encode(True),
        "decode": lambda: decode(False),
        "check + decode": lambda: decode(True),
    }
    best = {name: float("inf") for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)

    nbytes = sum(plan.sent_nbytes()[s] for s in Stream)
    print(
        f"{args.tokens} tokens, {args.layers} layers x {args.heads} heads x {args.head_dim}, bf16, "
        f"residual {args.residual}, {nbytes / 1e6:.1f} MB checksummed, {args.threads} thread(s), "
        f"fastest of {args.repeats}"
    )
    for name, seconds in best.items():
        print(f"  {name:20s} {seconds * 1e3:9.2f} ms")
    encode_cost = best["encode + checksums"] / best["encode"] - 1
    check_cost = best["check + decode"] / best["decode"] - 1
    print(f"  checksums add {100 * encode_cost:.1f}% to encode, the check {100 * check_cost:.1f}% to decode")


if __name__ == "__main__":
    main()
