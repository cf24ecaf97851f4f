"""The ``bytes`` step: the Triton kernels write the CPU codec's bytes, SHA-256 for SHA-256.

Runs:    per codec mode of ``codec_bench.MODES``, one seeded KV pool segment of SmolLM2's
         shape (``--bytes-tokens`` tokens, as benchmark/codec.py makes it) encoded, decoded
         Anchor-only and decoded fully by each path: ``cpu-torch`` (the torch reference),
         ``cpu-cpp`` (the C++ codec, where it built) and ``triton``.
Device:  the CPU for the reference and the C++ codec; the first CUDA device for Triton.
Reports: one row per mode (the paths found equal, or those that differ and in which parts);
         details: every path's digests of the Anchor, the Residual, the Anchor-only and the
         fully decoded rows, and what differs from the reference.
Fails:   when any path's digest of any part differs from the reference's in any mode. A C++
         codec that did not build does not fail the step: Triton is then compared with the
         reference alone, and the reason says so.

Provides:
    plan_bytes(options) - the modes, paths, segment and parts it would compare.
    step_bytes(ctx) - run it.
    compare_paths(digests, reference) - per path, the parts whose digest differs from the
        reference path's (pure).
"""

from __future__ import annotations

from typing import Any

from lynx.tools.gpu_check.common import Context, Item, StepResult, overall_status
from lynx.tools.gpu_check.options import Options

BYTES_PATHS = ("cpu-torch", "cpu-cpp", "triton")  # the reference first; cpu-cpp where it builds


def plan_bytes(options: Options) -> tuple[str, dict[str, Any]]:
    from lynx.tools.codec_bench import DIGEST_PARTS, MODES, SMOLLM2_LAYOUT

    return (
        f"{len(MODES)} codec modes x {', '.join(BYTES_PATHS)} on a {options.bytes_tokens}-token segment: "
        "SHA-256 of anchor, residual, decoded rows",
        {
            "layout": str(SMOLLM2_LAYOUT),
            "tokens": options.bytes_tokens,
            "modes": list(MODES),
            "paths": list(BYTES_PATHS),
            "compared": list(DIGEST_PARTS),
        },
    )


def compare_paths(digests: dict[str, dict[str, str]], reference: str = "cpu-torch") -> dict[str, list[str]]:
    """For each path but the reference, the digest parts in which it differs from it."""
    from lynx.tools.codec_bench import differing_parts

    return {
        path: differing_parts(digests[reference], found)
        for path, found in digests.items()
        if path != reference
    }


def step_bytes(ctx: Context) -> StepResult:
    from lynx.codec import cpp_backend
    from lynx.tools.codec_bench import MODES, SMOLLM2_LAYOUT, cpu_backend, make_segment

    tokens = ctx.options.bytes_tokens
    cpp = cpp_backend.available()
    items, modes = [], {}
    for name, config in MODES.items():
        digests: dict[str, dict[str, str]] = {}
        with cpu_backend("reference"):
            digests["cpu-torch"] = make_segment(SMOLLM2_LAYOUT, tokens, config, "cpu").digests()
        if cpp:
            with cpu_backend("cpp"):
                digests["cpu-cpp"] = make_segment(SMOLLM2_LAYOUT, tokens, config, "cpu").digests()
        digests["triton"] = make_segment(SMOLLM2_LAYOUT, tokens, config, "cuda").digests()
        differ = compare_paths(digests)
        bad = {path: parts for path, parts in differ.items() if parts}
        if bad:
            result = "; ".join(
                f"{path} differs from cpu-torch in {', '.join(parts)}" for path, parts in bad.items()
            )
        else:
            result = " = ".join(digests) + ": anchor, residual, decoded rows"
        items.append(Item(name, "failed" if bad else "ok", result))
        modes[name] = {"digests": digests, "differing": differ}
    status = overall_status(items)
    failed = [item.name for item in items if item.status == "failed"]
    reason = (
        f"{len(items)} modes, Triton bytes = CPU bytes"
        if status == "ok"
        else f"different bytes in {', '.join(failed)}"
    )
    if not cpp:
        reason += " (C++ codec did not build: compared Triton with the torch reference only)"
    return StepResult(
        "bytes",
        status,
        reason,
        items=items,
        details={"tokens": tokens, "layout": str(SMOLLM2_LAYOUT), "cpp_available": cpp, "modes": modes},
    )
