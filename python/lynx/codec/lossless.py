"""The lossless Residual (``residual="exact"``): the reference coder and its format.

Given the Anchor, a value's original word is one of the few words near its Anchor-only
reconstruction ``a`` (the word ``decode`` writes without a Residual): the Residual codes
how far away, entropy-coded with a model of how wide the anchor step is around ``a``.
Anchor + Residual decode to the original words bit for bit. The C++ codec
(``csrc/cpu_codec_lossless.h``) writes the same bytes; this module is the specification
and the oracle it is tested against (its decoder is a plain loop: the specification, not a
serving path).

Per value (``W``-bit words, ``M`` fraction bits: bf16 16/7, fp16 16/10, fp32 32/23)
-------------------------------------------------------------------------------------
* ``ordinal(w)``: the word as a signed integer in the order of the numbers it stands for,
  ``-(w & ~sign) - 1`` for a negative word, ``w`` otherwise (so ``-0.0`` is -1, ``+0.0``
  is 0: every word keeps its own ordinal).
* ``d = ordinal(x) - ordinal(a)``, zigzagged ``z = 2d`` (``d >= 0``) or ``-2d - 1``:
  ``0 <= z < 2**(W+1)``.
* Symbol ``s``: the bit length of ``z`` (0 for ``z = 0``), ``0..W+1``; then ``s - 1`` raw
  bits, ``z - 2**(s-1)`` (none for ``s <= 1``).
* Context ``c = clamp(E(scale) - E(a) + M, 0, W + 1)`` with ``E`` the biased exponent field
  of a word (0 for zeros and subnormals) and ``scale`` the value's group scale: about the
  bit length of a ``z`` that lands half an anchor step from ``a``, so values whose steps
  span as many words around them share a model.

Part body (what one part's Residual is; at most ``1 + n * C * W / 8`` bytes)
----------------------------------------------------------------------------
* byte 0 = ``RAW`` (0): the original words follow in element order. Chosen whenever the
  coded body would not be smaller, so incompressible data costs one byte more than raw.
* byte 0 = ``CODED`` (1): byte 1 = ``K``, the number of contexts used; ``K`` tables in
  increasing context order, each a context byte then ``ceil((W + 2) / 2)`` bytes of 4-bit
  code lengths (symbol ``j`` in the low nibble of byte ``j // 2`` for even ``j``, the high
  nibble for odd ``j``; 0: the symbol does not occur); then the block table: one ``<H``
  per block of ``BLOCK_VALUES`` values in element order (the last block may be shorter),
  the bits its values take in the stream (at most ``BLOCK_VALUES * (12 + W)`` < 2**16);
  then the bit stream, zero-padded to a byte, which ends with the body: exactly
  ``ceil(sum / 8)`` bytes for the block table's ``sum``.
* Why blocks: a value's bits start where the previous value's end, so one stream decodes
  serially; the block table tells a decoder where each block starts, so a GPU decodes
  every block of a part at once (``lossless_cuda.py``). It costs 2 bytes a block, about
  0.3% of a coded body.
* Codes: canonical Huffman codes from the lengths (shorter first, then by symbol; MSB-first
  code values), at most ``MAX_CODE_BITS`` long; a context with a single symbol codes it
  in zero bits (its length is written as 1). Lengths come from ``code_lengths``.
* Bit stream: for each value in element order its code, then its raw bits, packed
  LSB-first (bit ``i`` of the stream is bit ``i % 8`` of byte ``i // 8``); a code is
  written bit-reversed (its first bit first), raw bits least significant first.

A decoder refuses (``CodecInputError``) a body of another length than its content (a
stream of another length than its block table says included), a block whose values take
other bits than its count, an unknown format byte, contexts out of order or out of range,
lengths that are not a complete prefix code, a value whose context has no table, an
ordinal out of range, a non-finite word, and non-zero padding bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .format import CodecInputError

RAW = 0
CODED = 1
MAX_CODE_BITS = 12
"""Longest Huffman code: a decoder resolves any code with one 4096-entry table lookup."""
BLOCK_VALUES = 512
"""Values per block of the block table: a block's bit count fits a ``<H`` for every word
format (fp32: 512 * 44 bits)."""


@dataclass(frozen=True)
class WordFormat:
    """The word layout of a KV dtype, as the lossless code sees it."""

    word_bits: int
    fraction_bits: int

    @property
    def symbols(self) -> int:
        """Symbols (and contexts) per model: bit lengths 0..W+1."""
        return self.word_bits + 2

    @property
    def table_nbytes(self) -> int:
        """Bytes of one context's table: the context byte and the 4-bit lengths."""
        return 1 + (self.symbols + 1) // 2

    @property
    def word_nbytes(self) -> int:
        return self.word_bits // 8


_FORMATS = {
    torch.bfloat16: WordFormat(16, 7),
    torch.float16: WordFormat(16, 10),
    torch.float32: WordFormat(32, 23),
}
_WORD_DTYPES = {16: torch.int16, 32: torch.int32}


def word_format(dtype: torch.dtype) -> WordFormat:
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise CodecInputError(f"no lossless code for KV dtype {dtype}") from None


def max_body_nbytes(values: int, dtype: torch.dtype) -> int:
    """The largest body of a part of ``values`` values: the raw words and the format byte."""
    return 1 + values * word_format(dtype).word_nbytes


def unsigned_words(x: torch.Tensor) -> torch.Tensor:
    """The words of a float tensor as non-negative int64 (CPU)."""
    fmt = word_format(x.dtype)
    words = x.contiguous().view(_WORD_DTYPES[fmt.word_bits]).to(torch.int64)
    return words & ((1 << fmt.word_bits) - 1)


def float_words(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``unsigned_words``: non-negative int64 words as a ``dtype`` tensor."""
    bits = word_format(dtype).word_bits
    signed = torch.where(words >= 1 << (bits - 1), words - (1 << bits), words)
    return signed.to(_WORD_DTYPES[bits]).view(dtype)


def ordinals(words: torch.Tensor, fmt: WordFormat) -> torch.Tensor:
    """``ordinal`` (module docstring) of non-negative int64 words."""
    sign = 1 << (fmt.word_bits - 1)
    return torch.where(words >= sign, -(words - sign) - 1, words)


def words_of(ordinal: torch.Tensor, fmt: WordFormat) -> torch.Tensor:
    """Inverse of ``ordinals``."""
    sign = 1 << (fmt.word_bits - 1)
    return torch.where(ordinal < 0, (-ordinal - 1) + sign, ordinal)


def exponents(words: torch.Tensor, fmt: WordFormat) -> torch.Tensor:
    """Biased exponent fields of non-negative int64 words."""
    return (words >> fmt.fraction_bits) & ((1 << (fmt.word_bits - 1 - fmt.fraction_bits)) - 1)


def contexts(anchor_words: torch.Tensor, scale_words: torch.Tensor, fmt: WordFormat) -> torch.Tensor:
    """Context of each value from its Anchor-only word and its group's scale word."""
    c = exponents(scale_words, fmt) - exponents(anchor_words, fmt) + fmt.fraction_bits
    return c.clamp(0, fmt.symbols - 1)


def bit_lengths(z: torch.Tensor) -> torch.Tensor:
    """Bit length of each non-negative int64 (0 for 0)."""
    s = torch.zeros_like(z)
    rest = z.clone()
    for shift in (32, 16, 8, 4, 2, 1):
        big = rest >= (1 << shift)
        s += big * shift
        rest = torch.where(big, rest >> shift, rest)
    return s + (rest > 0)


def code_lengths(counts: list[int]) -> list[int]:
    """Huffman code lengths of one context's symbol counts, at most MAX_CODE_BITS.

    Deterministic, so every encoder writes the same bytes: leaves sorted by (count,
    symbol); the two-queue method, a leaf taken before a merged node of the same count;
    while the longest code is too long, every count c > 0 becomes (c + 1) // 2 and the code
    is built again. A single symbol gets length 1 (coded in zero bits)."""
    used = [s for s, c in enumerate(counts) if c > 0]
    lengths = [0] * len(counts)
    if len(used) == 1:
        lengths[used[0]] = 1
    if len(used) <= 1:
        return lengths
    weights = list(counts)
    while True:
        depth = _huffman_depths(weights, used)
        if max(depth.values()) <= MAX_CODE_BITS:
            for s, d in depth.items():
                lengths[s] = d
            return lengths
        weights = [(c + 1) // 2 for c in weights]


def _huffman_depths(weights: list[int], used: list[int]) -> dict[int, int]:
    leaves = sorted(used, key=lambda s: (weights[s], s))
    # nodes: leaves 0..n-1 (in sorted order), then merged nodes in creation order
    node_weight = [weights[s] for s in leaves]
    parent = [-1] * len(leaves)
    next_leaf, next_merged = 0, len(leaves)

    def take() -> int:
        nonlocal next_leaf, next_merged
        if next_leaf < len(leaves) and (
            next_merged >= len(node_weight) or node_weight[next_leaf] <= node_weight[next_merged]
        ):
            next_leaf += 1
            return next_leaf - 1
        next_merged += 1
        return next_merged - 1

    for _ in range(len(leaves) - 1):
        a, b = take(), take()
        parent.append(-1)
        node_weight.append(node_weight[a] + node_weight[b])
        parent[a] = parent[b] = len(node_weight) - 1
    depth = [0] * len(node_weight)
    for node in range(len(node_weight) - 2, -1, -1):
        depth[node] = depth[parent[node]] + 1
    return {s: depth[i] for i, s in enumerate(leaves)}


def canonical_codes(lengths: list[int]) -> list[int]:
    """Canonical code of each symbol, bit-reversed over its length (the stream's order);
    0 for unused symbols."""
    codes = [0] * len(lengths)
    code, previous = 0, 0
    for length, symbol in sorted((n, s) for s, n in enumerate(lengths) if n):
        code <<= length - previous
        previous = length
        codes[symbol] = int(f"{code:0{length}b}"[::-1], 2)
        code += 1
    return codes


def encode_body(
    words: torch.Tensor, anchor_words: torch.Tensor, scale_words: torch.Tensor, dtype: torch.dtype
) -> bytes:
    """The body of one part: ``words`` (the original values), ``anchor_words`` (their
    Anchor-only reconstruction) and ``scale_words`` (each value's group scale), all
    non-negative int64 in element order."""
    fmt = word_format(dtype)
    words, anchor_words, scale_words = words.reshape(-1), anchor_words.reshape(-1), scale_words.reshape(-1)
    raw = bytes([RAW]) + _raw_bytes(words, fmt)
    if words.numel() == 0:
        return raw
    d = ordinals(words, fmt) - ordinals(anchor_words, fmt)
    z = torch.where(d >= 0, 2 * d, -2 * d - 1)
    s = bit_lengths(z)
    c = contexts(anchor_words, scale_words, fmt)
    counts = torch.bincount(c * fmt.symbols + s, minlength=fmt.symbols**2).view(fmt.symbols, -1).tolist()
    header = bytearray([CODED, 0])
    lengths = torch.zeros(fmt.symbols, fmt.symbols, dtype=torch.int64)
    codes = torch.zeros_like(lengths)
    for context, row in enumerate(counts):
        if not any(row):
            continue
        header[1] += 1
        table = code_lengths(row)
        header.append(context)
        header += bytes(
            table[j] | (table[j + 1] << 4 if j + 1 < fmt.symbols else 0) for j in range(0, fmt.symbols, 2)
        )
        single = sum(1 for n in table if n) == 1
        lengths[context] = torch.tensor([0 if single else n for n in table])
        codes[context] = torch.tensor(canonical_codes(table))
    code_len = lengths[c, s]
    raw_len = (s - 1).clamp(min=0)
    raw_bits = torch.where(s >= 2, z - (torch.ones_like(z) << (s - 1).clamp(min=0)), torch.zeros_like(z))
    header += block_bits(code_len + raw_len).numpy().astype("<u2").tobytes()
    stream = _pack_lsb_first(codes[c, s], code_len, raw_bits, raw_len)
    coded = bytes(header) + stream
    return coded if len(coded) < len(raw) else raw


def blocks_of(values: int) -> int:
    """Entries of a coded body's block table for a part of ``values`` values."""
    return -(-values // BLOCK_VALUES)


def block_bits(value_bits: torch.Tensor) -> torch.Tensor:
    """The block table: the sum of each block's ``value_bits`` (int64, element order)."""
    padded = value_bits.new_zeros(blocks_of(value_bits.numel()) * BLOCK_VALUES)
    padded[: value_bits.numel()] = value_bits
    return padded.view(-1, BLOCK_VALUES).sum(1)


def _raw_bytes(words: torch.Tensor, fmt: WordFormat) -> bytes:
    return words.numpy().astype(f"<u{fmt.word_nbytes}").tobytes()


def _pack_lsb_first(
    codes: torch.Tensor, code_len: torch.Tensor, raw: torch.Tensor, raw_len: torch.Tensor
) -> bytes:
    """Concatenate (code, raw) bit fields of every value, LSB-first."""
    fields = np.stack([codes.numpy(), raw.numpy()], axis=1).reshape(-1).astype(np.uint64)
    widths = np.stack([code_len.numpy(), raw_len.numpy()], axis=1).reshape(-1).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
    total = int(widths.sum())
    out = np.zeros((total + 7) // 8 + 8, dtype=np.uint64)
    shifted_lo = fields << (starts % 8).astype(np.uint64)  # < 2**40: fits
    for k in range(6):  # a field of <= 33 bits shifted by <= 7 covers <= 5 bytes
        byte = (shifted_lo >> np.uint64(8 * k)) & np.uint64(0xFF)
        np.add.at(out, starts // 8 + k, byte)  # disjoint bits: adding is or-ing
    return out.astype(np.uint8)[: (total + 7) // 8].tobytes()


def decode_body(
    body: bytes | torch.Tensor, anchor_words: torch.Tensor, scale_words: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The original words (non-negative int64, element order) of a part from its body;
    CodecInputError if the body is corrupt."""
    fmt = word_format(dtype)
    data = bytes(body.numpy().tobytes() if isinstance(body, torch.Tensor) else body)
    anchor_words, scale_words = anchor_words.reshape(-1), scale_words.reshape(-1)
    values = anchor_words.numel()
    if not data:
        raise CodecInputError("corrupt lossless residual: an empty part body")
    if data[0] == RAW:
        if len(data) != 1 + values * fmt.word_nbytes:
            raise CodecInputError(
                f"corrupt lossless residual: a raw part body of {len(data)} bytes for {values} values"
            )
        words = torch.from_numpy(np.frombuffer(data, dtype=f"<u{fmt.word_nbytes}", offset=1).astype(np.int64))
    elif data[0] == CODED:
        words = _decode_coded(data, anchor_words, scale_words, fmt)
    else:
        raise CodecInputError(f"corrupt lossless residual: unknown part format {data[0]}")
    if bool((exponents(words, fmt) == (1 << (fmt.word_bits - 1 - fmt.fraction_bits)) - 1).any()):
        raise CodecInputError("corrupt lossless residual: it decodes to a NaN or infinite word")
    return words


@dataclass(frozen=True)
class CodedHeader:
    """What precedes a coded body's bit stream."""

    contexts: np.ndarray
    """The contexts that have a table, in increasing order."""
    lengths: np.ndarray
    """(contexts, symbols): each table's code lengths."""
    block_starts: list[int]
    """Where each block's values start in the stream, in bits, then where the last ends."""
    stream_at: int
    """The stream's first byte in the body."""

    @property
    def tables(self) -> dict[int, list[int]]:
        """Context -> code lengths."""
        return dict(zip(self.contexts.tolist(), self.lengths.tolist(), strict=True))


def max_header_nbytes(values: int, fmt: WordFormat) -> int:
    """The longest a coded body's header can be for a part of ``values`` values: what a
    decoder that reads the stream elsewhere (a GPU's) copies of each body to check it."""
    return 2 + fmt.symbols * fmt.table_nbytes + 2 * blocks_of(values)


def read_header(data: bytes, length: int, values: int, fmt: WordFormat) -> CodedHeader:
    """The header of a coded body of ``length`` bytes (``data``: the body, or at least its
    first ``max_header_nbytes`` bytes), checked against the body's length."""
    contexts, lengths, at = _read_tables(data, length, fmt)
    block_starts, at = _read_blocks(data, length, at, values)
    return CodedHeader(contexts, lengths, block_starts, at)


def _read_tables(data: bytes, length: int, fmt: WordFormat) -> tuple[np.ndarray, np.ndarray, int]:
    """(contexts, their code lengths, where the block table starts); the first faulty
    table, in order, is refused."""
    if length < 2:
        raise CodecInputError("corrupt lossless residual: a coded part body without its table count")
    _check_given(data, 2)
    count = data[1]
    if count > fmt.symbols:
        raise CodecInputError(f"corrupt lossless residual: {count} code tables for {fmt.symbols} contexts")
    whole = min(count, (length - 2) // fmt.table_nbytes)  # the tables inside the body
    _check_given(data, 2 + whole * fmt.table_nbytes)
    raw = np.frombuffer(data, dtype=np.uint8, count=whole * fmt.table_nbytes, offset=2)
    raw = raw.reshape(whole, fmt.table_nbytes)  # whole may be 0: no -1 to infer
    contexts = raw[:, 0].astype(np.int64)
    nibbles = raw[:, 1:]
    lengths = (
        np.stack([nibbles & 0xF, nibbles >> 4], axis=2)
        .reshape(whole, 2 * nibbles.shape[1])[:, : fmt.symbols]
        .astype(np.int64)
    )
    previous = np.concatenate([[-1], contexts[:-1]])
    disordered = (contexts <= previous) | (contexts >= fmt.symbols)
    incomplete = ~_complete(lengths)
    padded = (nibbles[:, -1] >> 4 != 0) if fmt.symbols % 2 else np.zeros(whole, dtype=bool)
    faulty = np.flatnonzero(disordered | incomplete | padded)
    if faulty.size:
        i = faulty[0]
        if disordered[i]:
            raise CodecInputError(f"corrupt lossless residual: context {contexts[i]} out of order or range")
        if incomplete[i]:
            raise CodecInputError(
                f"corrupt lossless residual: the code of context {contexts[i]} is not complete"
            )
        raise CodecInputError("corrupt lossless residual: a table's padding nibble is not zero")
    if whole < count:
        raise CodecInputError("corrupt lossless residual: its tables run past the part body")
    return contexts, lengths, 2 + count * fmt.table_nbytes


def _check_given(data: bytes, nbytes: int) -> None:
    """``data`` holds the body's first ``nbytes`` bytes: a caller that passes fewer than
    the header it claims gets the codec's error, not numpy's."""
    if len(data) < nbytes:
        raise CodecInputError(
            f"lossless residual: the header needs the body's first {nbytes} bytes, {len(data)} given"
        )


def _complete(lengths: np.ndarray) -> np.ndarray:
    """Per row of code lengths, whether its non-zero lengths form a complete prefix code
    (Kraft sum exactly 1; a single symbol: length 1)."""
    used = lengths > 0
    n_used = used.sum(1)
    short = np.where(used, lengths, MAX_CODE_BITS).max(1, initial=0) <= MAX_CODE_BITS
    kraft = np.where(
        used & (lengths <= MAX_CODE_BITS), 1 << (MAX_CODE_BITS - np.minimum(lengths, MAX_CODE_BITS)), 0
    )
    single = (n_used == 1) & (lengths.max(1, initial=0) == 1)
    return single | ((n_used >= 2) & short & (kraft.sum(1) == 1 << MAX_CODE_BITS))


def _read_blocks(data: bytes, length: int, at: int, values: int) -> tuple[list[int], int]:
    """(where each block's values start in the stream, in bits, and after the last one the
    stream's end; where the stream starts), after checking that the stream's length is
    what the block table says."""
    count = blocks_of(values)
    if at + 2 * count > length:
        raise CodecInputError("corrupt lossless residual: its block table runs past the part body")
    _check_given(data, at + 2 * count)
    counts = np.frombuffer(data, dtype="<u2", count=count, offset=at)
    ends = [0, *np.cumsum(counts, dtype=np.int64).tolist()]
    at += 2 * count
    if length - at != -(-ends[-1] // 8):
        raise CodecInputError(
            f"corrupt lossless residual: a bit stream of {length - at} bytes, its block table says "
            f"{ends[-1]} bits"
        )
    return ends, at


def _decode_coded(
    data: bytes, anchor_words: torch.Tensor, scale_words: torch.Tensor, fmt: WordFormat
) -> torch.Tensor:
    header = read_header(data, len(data), anchor_words.numel(), fmt)
    tables, block_starts, at = header.tables, header.block_starts, header.stream_at
    decoders: dict[int, dict[tuple[int, int], int] | int] = {}
    for context, lengths in tables.items():
        used = [s for s, n in enumerate(lengths) if n]
        if len(used) == 1:
            decoders[context] = used[0]
        else:
            codes = canonical_codes(lengths)
            decoders[context] = {(lengths[s], codes[s]): s for s in used}
    ctx = contexts(anchor_words, scale_words, fmt).tolist()
    stream = data[at:] + bytes(8)
    total_bits = block_starts[-1]

    def bits(pos: int, count: int) -> int:
        return (int.from_bytes(stream[pos >> 3 : (pos >> 3) + 6], "little") >> (pos & 7)) & ((1 << count) - 1)

    pos = 0
    z = []
    for index, context in enumerate(ctx):
        decoder = decoders.get(context)
        if decoder is None:
            raise CodecInputError(f"corrupt lossless residual: no table for context {context}")
        if isinstance(decoder, int):
            s = decoder
        else:
            code, length = 0, 0
            while (length, code) not in decoder:
                if length == MAX_CODE_BITS:
                    raise CodecInputError("corrupt lossless residual: a code that is in no table")
                code |= bits(pos + length, 1) << length
                length += 1
            s = decoder[(length, code)]
            pos += length
        if s >= 2:
            z.append((1 << (s - 1)) + bits(pos, s - 1))
            pos += s - 1
        else:
            z.append(s)
        if pos > total_bits:
            raise CodecInputError("corrupt lossless residual: the bit stream ends early")
        block_ends = (index + 1) % BLOCK_VALUES == 0 or index + 1 == len(ctx)
        if block_ends and pos != block_starts[index // BLOCK_VALUES + 1]:
            raise CodecInputError(
                f"corrupt lossless residual: block {index // BLOCK_VALUES}'s values end at bit {pos}, "
                f"its table says {block_starts[index // BLOCK_VALUES + 1]}"
            )
    if pos < 8 * (len(data) - at) and bits(pos, 8 * (len(data) - at) - pos):
        raise CodecInputError("corrupt lossless residual: bytes or bits set past the last value")
    zt = torch.tensor(z, dtype=torch.int64)
    d = torch.where(zt % 2 == 0, zt // 2, -(zt + 1) // 2)
    ordinal = ordinals(anchor_words, fmt) + d
    half = 1 << (fmt.word_bits - 1)
    if bool(((ordinal < -half) | (ordinal >= half)).any()):
        raise CodecInputError("corrupt lossless residual: a value decodes out of the word range")
    return words_of(ordinal, fmt)
