"""The ``throughput`` step: the Triton codec's speed against the GPU's memory bandwidth.

Runs:    for the default (lossless Residual) and the INT8-Residual mode, a seeded segment of
         SmolLM2's shape of ``--throughput-tokens`` tokens encoded, decoded Anchor-only and
         decoded fully, each op timed as the median of ``--repeats`` calls after a warm-up;
         the CUDA cache is emptied afterwards (the pd step's servers share the GPU).
Device:  the first CUDA device.
Reports: one row per mode: each op's GB/s of bytes moved (read + written, ``moved_nbytes``)
         and its fraction of the peak bandwidth (``--peak-gbps``, else the table of known
         GPUs in ``device``, else "peak unknown"); details: seconds, bytes moved, GB/s moved
         and of input, fraction of peak per op and mode.
Fails:   only by an exception (out of memory, a kernel error): the figures are reported,
         not judged against a target.

Provides:
    plan_throughput(options) - the segment, modes, ops, repeats and the peak to measure
        against (looked up at run time unless ``--peak-gbps`` gives it).
    step_throughput(ctx) - run it.
    moved_nbytes(op, ...) - the bytes an op reads and writes (pure).
    fraction_text(gbps, peak) - a figure as a share of the peak, for the table (pure).
"""

from __future__ import annotations

from typing import Any

from lynx.tools.gpu_check.common import Context, Item, StepResult
from lynx.tools.gpu_check.device import Peak, peak_bandwidth
from lynx.tools.gpu_check.options import Options

THROUGHPUT_MODES = ("b4 keys/ch16 lossless (default)", "b4 keys/ch16 int8")
THROUGHPUT_OPS = ("encode", "decode_anchor", "decode_full")


def plan_throughput(options: Options) -> tuple[str, dict[str, Any]]:
    from lynx.tools.codec_bench import SMOLLM2_LAYOUT

    peak = peak_bandwidth(None, options.peak_gbps)
    peak_text = f"{peak.gbps:g} GB/s (--peak-gbps)" if peak.gbps is not None else "looked up by device name"
    return (
        f"{', '.join(THROUGHPUT_OPS)} of a {options.throughput_tokens}-token segment in "
        f"{len(THROUGHPUT_MODES)} modes, median of {options.repeats}; peak {peak_text}",
        {
            "layout": str(SMOLLM2_LAYOUT),
            "tokens": options.throughput_tokens,
            "modes": list(THROUGHPUT_MODES),
            "ops": list(THROUGHPUT_OPS),
            "repeats": options.repeats,
            "peak_gbps": peak.gbps if peak.gbps is not None else "from the device name at run time",
        },
    )


def moved_nbytes(op: str, input_nbytes: int, anchor_nbytes: int, residual_nbytes: int) -> int:
    """Bytes an op reads and writes: encode reads the rows and writes both halves; decode
    reads the Anchor (and the Residual for a full decode) and writes the rows."""
    if op == "encode":
        return input_nbytes + anchor_nbytes + residual_nbytes
    if op == "decode_anchor":
        return anchor_nbytes + input_nbytes
    if op == "decode_full":
        return anchor_nbytes + residual_nbytes + input_nbytes
    raise ValueError(f"unknown op {op!r}")


def fraction_text(gbps: float, peak: Peak) -> str:
    return "peak unknown" if peak.gbps is None else f"{gbps / peak.gbps:.0%} of peak"


def step_throughput(ctx: Context) -> StepResult:
    from functools import partial

    import torch

    from lynx.tools.codec_bench import MODES, SMOLLM2_LAYOUT, make_segment, timed

    peak, tokens, repeats = ctx.peak, ctx.options.throughput_tokens, ctx.options.repeats
    items, rows = [], []
    for name in THROUGHPUT_MODES:
        segment = make_segment(SMOLLM2_LAYOUT, tokens, MODES[name], "cuda")
        calls = {
            "encode": segment.encode,
            "decode_anchor": partial(segment.decode, with_residual=False),
            "decode_full": segment.decode,
        }
        segment.encode()  # the decodes need an Anchor and a Residual
        row: dict[str, Any] = {"mode": name, "tokens": tokens, "input_bytes": segment.input_nbytes}
        texts = []
        for op in THROUGHPUT_OPS:
            seconds = timed(calls[op], repeats, "cuda")
            moved = moved_nbytes(op, segment.input_nbytes, segment.anchor.numel(), segment.residual.numel())
            gbps = moved / seconds / 1e9
            row[op] = {
                "seconds": seconds,
                "moved_bytes": moved,
                "GBps": gbps,
                "input_GBps": segment.input_nbytes / seconds / 1e9,
                "fraction_of_peak": None if peak.gbps is None else gbps / peak.gbps,
            }
            texts.append(f"{op} {gbps:.0f} GB/s ({fraction_text(gbps, peak)})")
        rows.append(row)
        items.append(Item(name, "ok", ", ".join(texts)))
        del segment, calls
    torch.cuda.empty_cache()  # the pd step's servers share this GPU
    peak_text = "peak unknown" if peak.gbps is None else f"of {peak.gbps:.0f} GB/s peak ({peak.source})"
    encode = rows[0]["encode"]
    reason = (
        f"default mode: encode {encode['GBps']:.0f} GB/s, "
        f"full decode {rows[0]['decode_full']['GBps']:.0f} GB/s moved, {peak_text}"
    )
    return StepResult(
        "throughput",
        "ok",
        reason,
        items=items,
        details={"peak_gbps": peak.gbps, "peak_source": peak.source, "rows": rows},
    )
