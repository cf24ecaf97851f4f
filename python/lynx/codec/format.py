"""The Lynx codec wire format: settings, handshake bytes and the byte layout of a segment.

This module is the one place where the bytes on the wire are defined. Everything a peer
needs to decode is either in the handshake (``CodecConfig.to_wire()`` and
``KVLayout.to_wire()``, compared at bootstrap) or follows from it and the token count of a
segment; nothing is inferred from buffer sizes.

Quantization (per group of values; all arithmetic in float32, in this order)
---------------------------------------------------------------------------
``b = anchor_bits`` (2..4), ``L = 2**b - 1`` anchor levels, ``r = 8 - b`` residual bits.

* ``lo``/``hi``: minimum and maximum of the group, plus ``0.0`` (a ``-0.0`` extreme becomes
  ``+0.0``: which zero a min/max returns would otherwise depend on the reduction order).
* ``scale = round_up_p(((hi * 0.5 - lo * 0.5) / L) * 2)``: the anchor step, rounded *up*
  to the parameter dtype ``p`` (the KV dtype: bf16, fp16 or fp32) so the codes fill
  ``0..L`` without clipping and the stored value is the one the encoder used. Halving
  first keeps groups that span the whole float range finite.
* ``t = (x * 0.5 - lo * 0.5) / d`` with ``d = scale * 0.5`` (``d = 1`` when ``scale`` is
  0, a constant group): the position of ``x`` in anchor steps.
* Anchor code ``u = clamp(round_half_even(t), 0, L)``: a correctly rounded b-bit code.
* Residual code (``residual="int8"``) ``v = clamp(round_half_even((t - u) * 2**r),
  -2**(r-1), 2**(r-1) - 1)``, stored as ``v + 2**(r-1)``. ``u * 2**r + v`` is the code on
  a grid ``2**r`` times finer: INT8 resolution.
* Decode: ``w = u`` (Anchor only) or ``w = u + v * 2**-r`` (exact in float32), then
  ``y = clamp((w * (scale * 0.5) + lo * 0.5) * 2, -max_p, max_p)`` cast to the KV dtype
  with round-to-nearest-even (``max_p``: the largest finite value of the KV dtype).
* Residual ``"exact"`` (the default): lossless, the original words coded against the
  Anchor (``lossless.py`` specifies the code): each value's distance, in words, from its
  Anchor-only reconstruction, entropy-coded per part with a model chosen by how many
  words an anchor step spans there. Anchor + Residual decode to the original words bit
  for bit; its size depends on the data, at most the raw words plus a few header bytes.

Groups
------
* Values (and keys with ``key_layout="per_token"``): ``group_size`` consecutive channels
  of one token (one head: ``group_size`` divides ``head_dim``).
* Keys with ``key_layout="per_channel"``: one channel over ``key_block`` consecutive
  tokens of the segment, blocks starting at the segment's first token; the last block
  may be partial (its groups have fewer members; nothing is padded on the wire).

Packing of k-bit codes
----------------------
Codes are laid out in element order of the part (token-major, then head, then channel)
regardless of how the groups run. Every 8 consecutive codes form one little-endian
integer of ``8 * k`` bits, code ``j`` at bits ``[k * j, k * j + k)``, written as ``k``
bytes. (For k = 4: byte ``i`` holds code ``2i`` in its low nibble, ``2i + 1`` in its high
nibble.)

Segment layout
--------------
A segment is ``n`` tokens of one request, all layers, K and V. Its Anchor and its
Residual are two separate byte strings, each the concatenation of one *part* per
``(layer, kind)`` in the order layer 0 K, layer 0 V, layer 1 K, ... . A part covers the
``n x (num_kv_heads * head_dim)`` matrix of one layer's K or V. Every array below starts
at a multiple of ``ALIGN`` bytes from the segment start (zero padding in between):

* Anchor part:   ``mins`` (one ``p`` value per group, group order below),
  ``scales`` (likewise), ``codes`` (b-bit, packed as above).
* Residual part, ``"int8"``: ``codes`` (r-bit, packed).

An ``"exact"`` Residual of a segment is one variable-length string, at most
``segment_nbytes`` (its *capacity*): a ``<I`` byte count ``used`` of the whole string (a
multiple of ``ALIGN``), ``<I`` end offsets of each part's body (from the string's start,
non-decreasing; the first body starts right after them), the part bodies
(``lossless.py``) back to back, then zeros up to ``used``. Only ``used`` bytes travel;
the capacity is the raw words of every part, a byte per part, the offsets and
alignment.

Group order: per-token groups run (token, head, group-in-head); per-channel key groups
run (block, head, channel).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any, Literal

import torch

WIRE_VERSION = 3
"""Bumped whenever any byte produced by this package changes meaning (2: the lossless
``"exact"`` Residual, the default; 3: its coded bodies carry a block table, so that a GPU
decodes every block of a part at once)."""

ALIGN = 16
"""Every array of a segment starts at a multiple of this many bytes."""

_CONFIG_MAGIC = b"LXC"
_LAYOUT_MAGIC = b"LXL"
_CONFIG_STRUCT = struct.Struct("<3sBBHBBH")
_LAYOUT_STRUCT = struct.Struct("<3sBHHHB")
CONFIG_WIRE_NBYTES = _CONFIG_STRUCT.size
LAYOUT_WIRE_NBYTES = _LAYOUT_STRUCT.size

Residual = Literal["int8", "exact"]
KeyLayout = Literal["per_channel", "per_token"]
Kind = Literal["key", "value"]

_RESIDUAL_CODES: dict[str, int] = {"int8": 0, "exact": 1}
_KEY_LAYOUT_CODES: dict[str, int] = {"per_channel": 0, "per_token": 1}
_DTYPE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
KV_DTYPES = tuple(_DTYPE_CODES)


class CodecError(ValueError):
    """Base class of the codec's errors."""


class CodecInputError(CodecError):
    """Input the codec refuses: non-finite values, odd shapes, dtypes or buffer sizes."""


class WireMismatchError(CodecError):
    """A peer's codec settings or KV layout differ from ours (refuse to pair)."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class CodecConfig:
    """Settings of the progressive codec; both peers must hold equal ones.

    Defaults are the measured choice (docs/codec.md): 4-bit anchors, keys per channel over
    blocks of 16 tokens, values per token in groups of 32, and the lossless residual, so
    Anchor + Residual is the KV cache bit for bit (``"int8"``: INT8 resolution, opt-in).
    """

    anchor_bits: int = 4
    group_size: int = 32
    residual: Residual = "exact"
    key_layout: KeyLayout = "per_channel"
    key_block: int = 16

    def __post_init__(self) -> None:
        if self.anchor_bits not in (2, 3, 4):
            raise CodecInputError(f"anchor_bits must be 2, 3 or 4, got {self.anchor_bits!r}")
        if not (_is_power_of_two(self.group_size) and 8 <= self.group_size <= 256):
            raise CodecInputError(f"group_size must be a power of two in 8..256, got {self.group_size!r}")
        if self.residual not in _RESIDUAL_CODES:
            raise CodecInputError(f"residual must be 'int8' or 'exact', got {self.residual!r}")
        if self.key_layout not in _KEY_LAYOUT_CODES:
            raise CodecInputError(f"key_layout must be 'per_channel' or 'per_token', got {self.key_layout!r}")
        if not (_is_power_of_two(self.key_block) and 2 <= self.key_block <= 256):
            raise CodecInputError(f"key_block must be a power of two in 2..256, got {self.key_block!r}")

    @property
    def residual_is_variable(self) -> bool:
        """Whether a segment's Residual is shorter than its capacity, by how well it codes
        (``"exact"``); the length then travels in its first word (module docstring)."""
        return self.residual == "exact"

    @property
    def residual_bits(self) -> int:
        """Bits per value of an ``"int8"`` residual."""
        return 8 - self.anchor_bits

    def to_wire(self) -> bytes:
        """Handshake bytes: magic, WIRE_VERSION and every setting (11 bytes)."""
        return _CONFIG_STRUCT.pack(
            _CONFIG_MAGIC,
            WIRE_VERSION,
            self.anchor_bits,
            self.group_size,
            _RESIDUAL_CODES[self.residual],
            _KEY_LAYOUT_CODES[self.key_layout],
            self.key_block,
        )

    @classmethod
    def from_wire(cls, data: bytes) -> CodecConfig:
        """Parse ``to_wire()`` bytes; raise WireMismatchError for another version/format."""
        if len(data) != _CONFIG_STRUCT.size:
            raise WireMismatchError(f"codec settings are {len(data)} bytes, expected {CONFIG_WIRE_NBYTES}")
        magic, version, bits, group, residual, key_layout, key_block = _CONFIG_STRUCT.unpack(data)
        if magic != _CONFIG_MAGIC:
            raise WireMismatchError(f"not Lynx codec settings (magic {magic!r})")
        if version != WIRE_VERSION:
            raise WireMismatchError(f"peer speaks codec wire version {version}, this side {WIRE_VERSION}")
        try:
            return cls(
                anchor_bits=bits,
                group_size=group,
                residual=_decode_code(_RESIDUAL_CODES, residual, "residual"),
                key_layout=_decode_code(_KEY_LAYOUT_CODES, key_layout, "key_layout"),
                key_block=key_block,
            )
        except CodecInputError as err:
            raise WireMismatchError(f"peer sent invalid codec settings: {err}") from err

    def check_peer(self, peer_wire: bytes) -> None:
        """Raise WireMismatchError unless the peer's ``to_wire()`` bytes equal ours."""
        peer = CodecConfig.from_wire(peer_wire)
        if peer != self:
            raise WireMismatchError(f"peer codec settings {peer} differ from ours {self}")


def _decode_code(table: dict[Any, int], code: int, what: str) -> Any:
    """The key of ``table`` whose wire code is ``code``."""
    for name, value in table.items():
        if value == code:
            return name
    raise WireMismatchError(f"unknown {what} code {code}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool: per layer, K and V buffers of (rows, num_kv_heads, head_dim)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not (isinstance(value, int) and 0 < value < 1 << 16):
                raise CodecInputError(f"{name} must be an int in 1..65535, got {value!r}")
        if self.head_dim % 8:
            raise CodecInputError(f"head_dim must be a multiple of 8, got {self.head_dim}")
        if self.dtype not in _DTYPE_CODES:
            raise CodecInputError(f"KV dtype must be one of {KV_DTYPES}, got {self.dtype}")

    @property
    def channels(self) -> int:
        """Values per token per layer and kind: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def to_wire(self) -> bytes:
        """Handshake bytes: magic, WIRE_VERSION, layers, heads, head_dim, dtype (11 bytes)."""
        return _LAYOUT_STRUCT.pack(
            _LAYOUT_MAGIC,
            WIRE_VERSION,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            _DTYPE_CODES[self.dtype],
        )

    @classmethod
    def from_wire(cls, data: bytes) -> KVLayout:
        if len(data) != _LAYOUT_STRUCT.size:
            raise WireMismatchError(f"KV layout is {len(data)} bytes, expected {LAYOUT_WIRE_NBYTES}")
        magic, version, layers, heads, head_dim, dtype = _LAYOUT_STRUCT.unpack(data)
        if magic != _LAYOUT_MAGIC:
            raise WireMismatchError(f"not a Lynx KV layout (magic {magic!r})")
        if version != WIRE_VERSION:
            raise WireMismatchError(f"peer speaks codec wire version {version}, this side {WIRE_VERSION}")
        return cls(layers, heads, head_dim, _decode_code(_DTYPE_CODES, dtype, "dtype"))

    def check_peer(self, peer_wire: bytes) -> None:
        """Raise WireMismatchError unless the peer's ``to_wire()`` bytes equal ours."""
        peer = KVLayout.from_wire(peer_wire)
        if peer != self:
            raise WireMismatchError(f"peer KV layout {peer} differs from ours {self}")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class PartLayout:
    """Byte offsets of one part (one layer's K or V for n tokens), relative to the part."""

    n_tokens: int
    channels: int
    num_groups: int
    param_nbytes: int
    mins_offset: int
    scales_offset: int
    codes_offset: int
    anchor_nbytes: int
    residual_nbytes: int


def num_groups(n_tokens: int, channels: int, kind: Kind, config: CodecConfig) -> int:
    """Groups of one part: per token (channels / group_size each) or per key block."""
    if kind == "key" and config.key_layout == "per_channel":
        return -(-n_tokens // config.key_block) * channels
    return n_tokens * (channels // config.group_size)


@functools.lru_cache(maxsize=4096)  # a few shapes per server, asked for per part of every segment
def part_layout(
    n_tokens: int, channels: int, kind: Kind, config: CodecConfig, dtype: torch.dtype
) -> PartLayout:
    """Offsets and sizes of one part; the single definition every encoder/decoder uses."""
    if dtype not in _DTYPE_CODES:
        raise CodecInputError(f"KV dtype must be one of {KV_DTYPES}, got {dtype}")
    if n_tokens < 0 or channels <= 0 or channels % 8:
        raise CodecInputError(
            f"a part needs n_tokens >= 0 and a positive multiple of 8 channels, "
            f"got n_tokens={n_tokens}, channels={channels}"
        )
    per_token = kind == "value" or config.key_layout == "per_token"
    if per_token and channels % config.group_size:
        raise CodecInputError(
            f"group_size {config.group_size} does not divide the {channels} channels of a token"
        )
    itemsize = dtype.itemsize
    groups = num_groups(n_tokens, channels, kind, config)
    values = n_tokens * channels
    param_nbytes = groups * itemsize
    scales_offset = _align(param_nbytes)
    codes_offset = scales_offset + _align(param_nbytes)
    anchor = codes_offset + _align(values * config.anchor_bits // 8)
    if config.residual == "exact":
        residual = 1 + values * itemsize  # a lossless body's capacity: format byte, raw words
    else:
        residual = _align(values * config.residual_bits // 8)
    return PartLayout(
        n_tokens=n_tokens,
        channels=channels,
        num_groups=groups,
        param_nbytes=param_nbytes,
        mins_offset=0,
        scales_offset=scales_offset,
        codes_offset=codes_offset,
        anchor_nbytes=anchor,
        residual_nbytes=residual,
    )


def check_layout(layout: KVLayout, config: CodecConfig) -> None:
    """Groups must not straddle heads."""
    if layout.head_dim % config.group_size:
        raise CodecInputError(f"group_size {config.group_size} does not divide head_dim {layout.head_dim}")


def segment_nbytes(layout: KVLayout, n_tokens: int, config: CodecConfig) -> tuple[int, int]:
    """(anchor_nbytes, residual_nbytes) of a segment of n_tokens (all layers, K and V)."""
    check_layout(layout, config)
    key = part_layout(n_tokens, layout.channels, "key", config, layout.dtype)
    value = part_layout(n_tokens, layout.channels, "value", config, layout.dtype)
    residual = layout.num_layers * (key.residual_nbytes + value.residual_nbytes)
    if config.residual_is_variable:  # an empty segment has empty halves, no head
        residual = _align(residual_header_nbytes(layout) + residual) if n_tokens else 0
    return layout.num_layers * (key.anchor_nbytes + value.anchor_nbytes), residual


def residual_header_nbytes(layout: KVLayout) -> int:
    """Bytes of a variable-length segment Residual's head: its length and the part ends."""
    return 4 * (1 + 2 * layout.num_layers)
