"""What the decode side's checks of issue 26 cost, on ``ProgressiveReceiver`` itself:

* a notice: ``on_notice`` for a LANDED of a live reservation (head, lookup, then the
  checksum array the plan allows), for one of an unknown nonce (head and lookup only),
  and for a forged 32 MiB frame (dropped unread), in microseconds per notice;
* the refinement (speculative mode, ``write_kv`` once the Residual landed): its time,
  and what re-checking the Anchor's checksums there adds (one ``span_checksum`` pass
  over the Anchor stream's ranges, as ``write_kv`` does), as a share of it.

Default shape: SmolLM2-135M's KV (30 layers x 3 KV heads x 64, bf16), 4096 tokens, INT8
Residual, checksums on. Each figure is the fastest of ``--repeats`` runs.

    PYTHONPATH=python python benchmark/refine_check_cost.py --threads 1
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

import torch
from checksum_cost import kv_parser, synthetic_kv

from lynx.codec import CodecConfig, encode_pages
from lynx.mode import Mode
from lynx.transfer import AuxStatus, Handshake, Notice, NoticeKind, ProgressiveReceiver, RequestLayout, Stream
from lynx.transfer.protocol import TAG, checksum_values, span_checksum

ROOM = 1


def fastest(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Seconds per call of ``fn``: the fastest of ``repeats`` rounds of ``inner`` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def main() -> None:
    args = kv_parser(__doc__, repeats=7).parse_args()
    layout, k, v, slots = synthetic_kv(args)
    handshake = Handshake(Mode.SPECULATIVE, CodecConfig(residual=args.residual), layout, checksums=True)
    plan = RequestLayout.of(handshake, args.tokens)
    buffer = torch.zeros(2 * plan.receive_nbytes, dtype=torch.uint8)
    receiver = ProgressiveReceiver(
        buffer=buffer,
        k_buffers=[torch.zeros_like(t) for t in k],
        v_buffers=[torch.zeros_like(t) for t in v],
        handshake=handshake,
        deadline_s=60.0,
    )
    receiver.register(ROOM, args.tokens, peer="prefill")
    offer = receiver.reserve(ROOM)
    assert offer is not None
    base = offer.anchor_addr - buffer.data_ptr()
    space = buffer[base : base + plan.receive_nbytes]
    encoded = torch.zeros(plan.encoded_nbytes, dtype=torch.uint8)
    for seg in plan.segments:
        anchor, residual = plan.byte_ranges(seg)
        encode_pages(k, v, slots[seg.start : seg.end], handshake.codec, encoded[anchor], encoded[residual])
    space.copy_(encoded[: plan.receive_nbytes])
    counts = plan.residual_nbytes_in(space)
    landed: dict[Stream, list[bytes]] = {}
    for stream in plan.streams:
        ranges = plan.stream_ranges(stream, counts)
        sums = tuple(checksum_values([span_checksum(space[span]) for _, span in ranges]))
        nbytes = sum(span.stop - span.start for _, span in ranges)
        landed[stream] = Notice(
            NoticeKind.LANDED, ROOM, offer.nonce, stream=stream, nbytes=nbytes, checksums=sums
        ).to_frames()
    accept = Notice(NoticeKind.ACCEPT, ROOM, offer.nonce, handshake=handshake.to_wire()).to_frames()
    receiver.on_notice(accept)
    receiver.on_notice(landed[Stream.ANCHOR])
    assert receiver.verdict(ROOM, AuxStatus.SUCCESS)[0].value == "ready"
    receiver.write_kv(ROOM, slots)  # decoding on the Anchor

    live = landed[Stream.ANCHOR][2]
    other = live[:8] + struct.pack("<Q", offer.nonce ^ 1) + live[16:]  # the nonce changed
    unknown = [TAG, NoticeKind.LANDED.value, other]
    forged = [TAG, NoticeKind.LANDED.value, other[:30] + bytes(32 << 20)]
    per_notice = {
        "LANDED, live reservation (a repeat: parsed, then ignored)": landed[Stream.ANCHOR],
        "LANDED, unknown nonce": unknown,
        "forged 32 MiB frame": forged,
    }
    print(f"{args.tokens} tokens, {len(plan.segments)} segments, {args.threads} thread(s)")
    for what, frames in per_notice.items():
        seconds = fastest(lambda frames=frames: receiver.on_notice(frames), args.repeats, inner=200)
        print(f"on_notice, {what}: {seconds * 1e6:.1f} us")

    receiver.on_notice(landed[Stream.RESIDUAL])
    anchor_ranges = [span for _, span in plan.stream_ranges(Stream.ANCHOR, counts)]

    def recheck() -> None:
        checksum_values([span_checksum(space[span]) for span in anchor_ranges])

    def refine() -> None:
        state = receiver._rooms[ROOM]  # a benchmark: undo the refinement, keep the Anchor decode
        state.refined = False
        receiver.write_kv(ROOM, slots)

    check_s = fastest(recheck, args.repeats)
    refine_s = fastest(refine, args.repeats)
    print(
        f"refinement (write_kv once the Residual landed): {refine_s * 1e3:.2f} ms, of which the "
        f"Anchor re-check {check_s * 1e3:.2f} ms ({100 * check_s / refine_s:.1f}%; "
        f"{plan.anchor_nbytes / (1 << 20):.1f} MiB of Anchor)"
    )


if __name__ == "__main__":
    main()
