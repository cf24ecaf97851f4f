"""What ``benchmark/codec.py`` and the GPU check's bytes and throughput steps
(``lynx.tools.gpu_check``) share to measure the codec and to compare its paths byte for
byte: the codec modes, a seeded SGLang-style KV pool segment (per layer K and V buffers of
(rows, heads, head_dim), token slots scattered over twice as many rows), the median timer,
the CPU path switch and SHA-256 digests of what a path wrote.

The same seed gives the same pool on every device, so two paths wrote the same bytes when
their digests agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lynx.codec import CodecConfig, KVLayout, decode_pages, encode_pages, segment_nbytes
from lynx.codec.backend import BACKEND_ENV

MODES = {
    "b4 keys/ch16 lossless (default)": CodecConfig(),
    "b4 keys/ch16 int8": CodecConfig(residual="int8"),
    "b3 keys/ch16 int8": CodecConfig(anchor_bits=3, residual="int8"),
    "b2 keys/ch16 int8": CodecConfig(anchor_bits=2, residual="int8"),
    "b4 per-token g32 int8": CodecConfig(key_layout="per_token", residual="int8"),
}

# SmolLM2-135M's KV pool: 30 layers x 3 KV heads x 64, bf16.
SMOLLM2_LAYOUT = KVLayout(30, 3, 64, torch.bfloat16)

# The parts ``Segment.digests`` names; "all" is one digest over anchor, residual and the
# fully decoded rows, in that order.
DIGEST_PARTS = ("anchor", "residual", "decoded_anchor_only", "decoded")


def timed(fn: Callable[[], None], repeats: int, device: str) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@contextlib.contextmanager
def cpu_backend(name: str) -> Iterator[None]:
    """Run CPU parts on ``name`` (``reference`` or ``cpp``, lynx.codec.backend) inside the
    block; CUDA tensors go to the Triton kernels whatever it says."""
    previous = os.environ.get(BACKEND_ENV)
    os.environ[BACKEND_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            del os.environ[BACKEND_ENV]
        else:
            os.environ[BACKEND_ENV] = previous


def _sha256(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Segment:
    """One segment of a seeded KV pool on ``device`` with its Anchor and Residual buffers."""

    layout: KVLayout
    config: CodecConfig
    device: str
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    slots: torch.Tensor
    anchor: torch.Tensor
    residual: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.slots.numel()

    @property
    def input_nbytes(self) -> int:
        """Bytes of the segment's K and V values (what encode reads, what decode writes)."""
        return 2 * self.layout.num_layers * self.tokens * self.layout.channels * self.layout.dtype.itemsize

    def encode(self) -> None:
        encode_pages(self.k, self.v, self.slots, self.config, self.anchor, self.residual)

    def decode(self, with_residual: bool = True) -> None:
        """Decode into the pool rows (Anchor-only values without the Residual)."""
        residual = self.residual if with_residual else None
        decode_pages(self.anchor, residual, self.k, self.v, self.slots, self.config)

    def _rows(self) -> list[torch.Tensor]:
        return [buf[self.slots] for buf in self.k + self.v]

    def digests(self) -> dict[str, str]:
        """Encode, decode Anchor-only, decode fully (the pool then holds the reconstruction)
        and return the SHA-256 of each of ``DIGEST_PARTS`` and of all together ("all")."""
        self.encode()
        self.decode(with_residual=False)
        anchor_only = _sha256(*self._rows())
        self.decode()
        rows = self._rows()
        return {
            "anchor": _sha256(self.anchor),
            "residual": _sha256(self.residual),
            "decoded_anchor_only": anchor_only,
            "decoded": _sha256(*rows),
            "all": _sha256(self.anchor, self.residual, *rows),
        }


def make_segment(layout: KVLayout, tokens: int, config: CodecConfig, device: str, seed: int = 0) -> Segment:
    """A pool of ``2 * tokens`` rows per layer (normal values x 2, seeded) on ``device``, a
    segment of ``tokens`` slots drawn from it, and empty Anchor and Residual buffers."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * tokens
    pool = [
        (torch.randn(rows, layout.num_kv_heads, layout.head_dim, generator=gen) * 2)
        .to(layout.dtype)
        .to(device)
        for _ in range(2 * layout.num_layers)
    ]
    slots = torch.randperm(rows, generator=gen)[:tokens].to(device)
    anchor_nbytes, residual_nbytes = segment_nbytes(layout, tokens, config)
    return Segment(
        layout=layout,
        config=config,
        device=device,
        k=pool[::2],
        v=pool[1::2],
        slots=slots,
        anchor=torch.empty(anchor_nbytes, dtype=torch.uint8, device=device),
        residual=torch.empty(residual_nbytes, dtype=torch.uint8, device=device),
    )


def differing_parts(reference: dict[str, str], other: dict[str, str]) -> list[str]:
    """The ``DIGEST_PARTS`` whose digests differ (or are missing) between two paths."""
    return [part for part in DIGEST_PARTS if part not in other or other[part] != reference.get(part)]
