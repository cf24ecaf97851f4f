"""What signing Lynx's control messages costs (``--lynx-auth-key-file``): microseconds to
sign and to verify one notice (``Notice.to_frames(key)``, ``unsigned_reason``) and one
offer, for a RELEASED (16 bytes of payload) and a LANDED of a 4096-token request (16
segments, so 16 checksums). Each figure is the fastest of ``--repeats`` runs of
``--number`` calls.

    PYTHONPATH=python python benchmark/auth_cost.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lynx.codec import CodecConfig, KVLayout
from lynx.transfer import Handshake, Notice, NoticeKind, Offer, Stream
from lynx.transfer.auth import AuthKey
from lynx.transfer.protocol import unsigned_reason

ROOM, NONCE = 7, 0x1234_5678_9ABC_DEF0


def fastest_us(fn: Callable[[], object], number: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    key = AuthKey(bytes(range(32)))
    handshake = Handshake("full", CodecConfig(), KVLayout(30, 3, 64, torch.bfloat16)).signed_with(key)
    offer = Offer(handshake.to_wire(), NONCE, 1 << 20, 1 << 20, 2 << 20, 1 << 20, 4096)
    signed_offer = offer.signed(key, ROOM)
    notices = {
        "RELEASED": Notice(NoticeKind.RELEASED, ROOM, NONCE),
        "LANDED (16 checksums)": Notice(
            NoticeKind.LANDED, ROOM, NONCE, stream=Stream.ANCHOR, nbytes=1 << 20, checksums=tuple(range(16))
        ),
    }
    n, r = args.number, args.repeats
    print(f"{'message':<24}{'unsigned us':>12}{'signed us':>11}{'verify us':>11}")
    for name, notice in notices.items():
        frames = notice.to_frames(key)
        print(
            f"{name:<24}{fastest_us(notice.to_frames, n, r):>12.2f}"
            f"{fastest_us(lambda notice=notice: notice.to_frames(key), n, r):>11.2f}"
            f"{fastest_us(lambda frames=frames: unsigned_reason(frames, key), n, r):>11.2f}"
        )
    print(
        f"{'offer':<24}{fastest_us(offer.to_wire, n, r):>12.2f}"
        f"{fastest_us(lambda: offer.signed(key, ROOM).to_wire(), n, r):>11.2f}"
        f"{fastest_us(lambda: signed_offer.verify(key, ROOM), n, r):>11.2f}"
    )


if __name__ == "__main__":
    main()
