"""The lossless Residual on a CUDA device: the same bytes as ``lossless.py`` (the
specification) and the C++ codec, coded and decoded where the KV pool is.

Encode (torch operations, one synchronisation): each value's context, symbol and raw bits
from its word and its Anchor-only word (the Triton Anchor decode); one histogram per
part, copied to the host, where ``lossless.code_lengths`` builds the codes; then every
value's field is placed at its bit offset (a prefix sum of the fields' widths) and or-ed
into the stream by an integer scatter-add (fields never overlap, so adding is or-ing). The
block table is the sum of each block's widths.

Decode: headers (at most ``lossless.max_header_nbytes`` bytes a part) copied to the host
and checked there (``lossless.read_header``); a 4096-entry lookup table per (part,
context) built on the device (canonical codes fill contiguous ranges of the 12 peeked bits
read most significant first); then the Triton kernel ``_decode_blocks``: one lane per
block of ``BLOCK_VALUES`` values, starting where the block table says and checking that it
ends where the table says. Words, range and non-finite checks in torch; the decoded words
are returned only when every part is sound (one synchronisation), so a caller writes no
row of a corrupt Residual.

16-bit words only (bf16, fp16): a value takes at most 12 + 16 bits, so a 64-bit window of
two 32-bit words holds it at any bit offset. ``supports`` says which; an fp32 pool's
lossless Residual is coded on the host (``backend.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from . import cpp_backend, lossless, reference, triton_kernels
from .format import CodecConfig, CodecInputError, Kind, part_layout

_PEEK = lossless.MAX_CODE_BITS
_LUT_SIZE = 1 << _PEEK
_LANES = 128  # blocks per program
_INVALID = -1  # a lookup entry of a context without a table
# faults as cpp_backend.RESIDUAL_FAULTS indexes them
_FAULT_NO_TABLE, _FAULT_RANGE, _FAULT_NON_FINITE, _FAULT_BLOCKS = 4, 6, 7, 9
_REVERSED: dict[torch.device, torch.Tensor] = {}  # device -> the 12-bit bit reversal of 0..4095


def supports(dtype: torch.dtype) -> bool:
    """Whether this path codes a pool of ``dtype`` (16-bit words)."""
    return dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LosslessPart:
    """One part as this module sees it: its Anchor bytes (on the device), its kind and its
    (tokens, channels)."""

    anchor: torch.Tensor
    kind: Kind
    shape: tuple[int, int]


def _words(x: torch.Tensor) -> torch.Tensor:
    """16-bit words of a tensor as int32 in 0..65535."""
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


@dataclass
class _Model:
    """Each value's Anchor-only word and context, all parts in one flat array."""

    anchor_words: torch.Tensor  # int32
    contexts: torch.Tensor  # int32
    starts: list[int]  # each part's first value, then the total
    part_of_value: torch.Tensor  # int64


def _model(parts: Sequence[LosslessPart], dtype: torch.dtype, config: CodecConfig) -> _Model:
    """Anchor-only words and contexts of every part: one Triton launch a part."""
    device = parts[0].anchor.device
    starts = np.concatenate([[0], np.cumsum([n * channels for n, channels in (p.shape for p in parts)])])
    total = int(starts[-1])
    anchor_only = torch.empty(total, dtype=dtype, device=device)
    contexts = torch.empty(total, dtype=torch.int32, device=device)
    for part, start, end in zip(parts, starts[:-1], starts[1:], strict=True):
        layout = part_layout(*part.shape, part.kind, config, dtype)
        rows = anchor_only[start:end].view(part.shape)
        triton_kernels.decode_rows(
            part.anchor, None, rows, None, part.kind, config, layout, contexts[start:end]
        )
    sizes = torch.from_numpy(np.diff(starts)).to(device)
    return _Model(
        _words(anchor_only),
        contexts,
        starts.tolist(),
        torch.repeat_interleave(torch.arange(len(parts), device=device), sizes, output_size=total),
    )


def encode_bodies(
    parts: Sequence[LosslessPart],
    values: Sequence[torch.Tensor],
    config: CodecConfig,
    outs: Sequence[torch.Tensor],
) -> list[int]:
    """Write the lossless body of each part's ``values`` (its (n, C) rows, its Anchor
    already encoded) into its ``out`` (its capacity, zeroed past the body); returns each
    body's length."""
    dtype = values[0].dtype
    fmt = lossless.word_format(dtype)
    symbols, device = fmt.symbols, values[0].device
    model = _model(parts, dtype, config)
    d = lossless.ordinals(_words(torch.cat([x.reshape(-1) for x in values])), fmt) - lossless.ordinals(
        model.anchor_words, fmt
    )
    z = torch.where(d >= 0, 2 * d, -2 * d - 1)  # < 2**17: exact as float32
    symbol = ((z.float().view(torch.int32) >> 23) - 126).clamp_(min=0)  # bit length of z
    key = model.contexts * symbols + symbol
    # one histogram per part; 32 copies of it, by value index, so that a warp's increments
    # fall on different counters rather than on the few hottest ones
    spread = (model.part_of_value * symbols * symbols + key) * 32 + (
        torch.arange(key.numel(), device=device) & 31
    )
    counts = torch.bincount(spread, minlength=len(parts) * symbols**2 * 32).view(
        len(parts), symbols, symbols, 32
    )
    counts_host = counts.sum(3).cpu().numpy()
    lengths, code_values = cpp_backend.huffman_codes(counts_host.reshape(-1, symbols))
    lengths = lengths.reshape(counts_host.shape)
    single = (lengths > 0).sum(2, keepdims=True) == 1  # a context with one symbol codes it in 0 bits
    code_bits = np.where(single, 0, lengths)
    code_values = code_values.reshape(counts_host.shape)
    raw_bits = np.maximum(np.arange(symbols) - 1, 0)
    stream_bits = (counts_host * (code_bits + raw_bits)).sum((1, 2))
    tables = np.concatenate(
        [
            np.broadcast_to(np.arange(symbols)[None, :, None], (len(parts), symbols, 1)),
            lengths[:, :, 0::2] | lengths[:, :, 1::2] << 4,
        ],
        axis=2,
    ).astype(np.uint8)  # per part and context: the context byte, then the 4-bit lengths
    headers, coded = [], []
    for index, part_counts in enumerate(counts_host):
        used = np.flatnonzero(part_counts.sum(1))
        header = bytes([lossless.CODED, len(used)]) + tables[index, used].tobytes()
        size = model.starts[index + 1] - model.starts[index]
        body = len(header) + 2 * lossless.blocks_of(size) + -(-int(stream_bits[index]) // 8)
        coded.append(body < lossless.max_body_nbytes(size, dtype))
        headers.append((header, int(stream_bits[index])))
    flat_key = model.part_of_value * symbols * symbols + key
    n_code = torch.from_numpy(code_bits).to(device).view(-1)[flat_key]
    n_raw = (symbol - 1).clamp_(min=0)
    width = n_code + n_raw
    code = torch.from_numpy(code_values).to(device).view(-1)[flat_key]
    field = code | ((z & ((1 << n_raw) - 1)).to(torch.int64) << n_code)
    # Every body is laid out in one image of the outputs' capacities, then copied out.
    capacity = [out.numel() for out in outs]
    base = np.concatenate([[0], np.cumsum(capacity)]).astype(np.int64)
    block_count = np.asarray([lossless.blocks_of(n) for n in np.diff(model.starts)], dtype=np.int64)
    header_at = np.concatenate([[0], np.cumsum([len(header) for header, _ in headers])]).astype(np.int64)
    stream_at = base[:-1] + np.diff(header_at) + 2 * block_count  # in the image, in bytes
    stream_nbytes = np.asarray([-(-bits // 8) for _, bits in headers], dtype=np.int64)
    is_coded = torch.from_numpy(np.asarray(coded)).to(device)[model.part_of_value]
    # The stream: each field at its bit in the image (a prefix sum of the widths), or-ed in
    # by adding to 32-bit words (fields never overlap); a field at bit o of word k is at
    # most 28 + 31 bits: its low 32 bits go to word k, the rest to word k + 1. A raw
    # part's values add nothing.
    prefix = torch.nn.functional.pad(torch.cumsum(width, 0), (1, 0))
    starts = torch.tensor(model.starts[:-1], device=device)
    at = prefix[:-1] - prefix[starts][model.part_of_value]
    at += 8 * torch.from_numpy(stream_at).to(device)[model.part_of_value]
    at = torch.where(is_coded, at, 0)  # a raw part's coded stream could run past its capacity
    shifted = torch.where(is_coded, field, 0) << (at & 31)
    words = torch.zeros(-(-int(base[-1]) // 4) + 2, dtype=torch.int64, device=device)
    words.index_add_(0, at >> 5, shifted & 0xFFFFFFFF)
    words.index_add_(0, (at >> 5) + 1, shifted >> 32)
    image = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).view(torch.uint8)
    # the block table: each block's bits, a difference of the prefix sum at its ends
    block_first = np.concatenate(
        [model.starts[i] + lossless.BLOCK_VALUES * np.arange(count) for i, count in enumerate(block_count)]
    )
    block_end = np.minimum(block_first + lossless.BLOCK_VALUES, np.repeat(model.starts[1:], block_count))
    blocks = prefix[torch.from_numpy(block_end).to(device)] - prefix[torch.from_numpy(block_first).to(device)]
    block_bytes = torch.stack([blocks & 0xFF, blocks >> 8], 1).to(torch.uint8).view(-1)
    block_at = 2 * np.concatenate([[0], np.cumsum(block_count)]).astype(np.int64)
    used = [
        int(stream_at[i] - base[i] + stream_nbytes[i])
        if coded[i]
        else lossless.max_body_nbytes(model.starts[i + 1] - model.starts[i], dtype)
        for i in range(len(parts))
    ]
    c = np.flatnonzero(coded)
    r = np.flatnonzero(~np.asarray(coded))
    header_bytes = torch.frombuffer(bytearray(b"".join(h for h, _ in headers)), dtype=torch.uint8).to(device)
    value_bytes = torch.cat([x.reshape(-1) for x in values]).view(torch.uint8)
    for source, source_at, target_at, length in (
        (header_bytes, header_at[c], base[c], np.diff(header_at)[c]),
        (block_bytes, block_at[c], base[c] + np.diff(header_at)[c], np.diff(block_at)[c]),
        (
            value_bytes,
            2 * np.asarray(model.starts, dtype=np.int64)[r],
            base[r] + 1,
            2 * np.diff(model.starts)[r],
        ),
    ):
        source_index, target_index = _ranges(source_at, target_at, length, device)
        image[target_index] = source[source_index]
    image = image[: int(base[-1])]
    spans = all(
        b.data_ptr() == a.data_ptr() + a.numel()
        and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        for a, b in itertools.pairwise(outs)
    )
    if spans:  # the outputs are one range of memory: one copy
        whole = torch.empty(0, dtype=torch.uint8, device=device)
        whole.set_(outs[0].untyped_storage(), outs[0].storage_offset(), (int(base[-1]),))
        whole.copy_(image)
    else:
        for out, at, size in zip(outs, base[:-1], capacity, strict=True):
            out.copy_(image[at : at + size])
    return used


def _ranges(
    source_at: np.ndarray, target_at: np.ndarray, length: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors that copy ranges: ``length[i]`` elements from ``source_at[i]`` to
    ``target_at[i]``, all ranges at once."""
    length_t = torch.from_numpy(np.asarray(length, dtype=np.int64)).to(device)
    total = int(np.sum(length))
    within = torch.arange(total, device=device) - torch.repeat_interleave(
        torch.cumsum(length_t, 0) - length_t, length_t, output_size=total
    )
    source = torch.repeat_interleave(
        torch.from_numpy(np.asarray(source_at, dtype=np.int64)).to(device), length_t, output_size=total
    )
    target = torch.repeat_interleave(
        torch.from_numpy(np.asarray(target_at, dtype=np.int64)).to(device), length_t, output_size=total
    )
    return source + within, target + within


def _reversed_bits(device: torch.device) -> torch.Tensor:
    if device not in _REVERSED:
        _REVERSED[device] = torch.tensor(
            [int(f"{j:0{_PEEK}b}"[::-1], 2) for j in range(_LUT_SIZE)], dtype=torch.int64, device=device
        )
    return _REVERSED[device]


def _lookup_tables(
    headers: Sequence[lossless.CodedHeader], symbols: int, device: torch.device
) -> torch.Tensor:
    """(parts * symbols * 4096) int16: for each part and context, what the next 12 bits of
    the stream (first bit lowest) decode to: symbol | code bits << 8, or ``_INVALID``.

    Canonical codes fill contiguous ranges of the 12 bits read most significant first, in
    (length, symbol) order: each symbol's entry repeated 2**(12 - length) times there, then
    the bits reversed."""
    lengths = np.zeros((len(headers), symbols, symbols), dtype=np.int64)
    present = np.zeros((len(headers), symbols), dtype=bool)
    for row, header in enumerate(headers):
        lengths[row, header.contexts] = header.lengths
        present[row, header.contexts] = True
    lengths = lengths.reshape(-1, symbols)
    used = lengths > 0
    single = used.sum(1, keepdims=True) == 1  # one symbol, coded in no bits
    order = np.argsort(np.where(used, lengths * 64 + np.arange(symbols), 1 << 30), axis=1, kind="stable")
    ordered = np.take_along_axis(lengths, order, axis=1)
    ordered_used = np.take_along_axis(used, order, axis=1)
    entries = order | np.where(single, 0, ordered) << 8
    repeats = np.where(ordered_used, np.where(single, _LUT_SIZE, 1 << (_PEEK - ordered)), 0)
    entries = np.concatenate([entries, np.full((len(entries), 1), _INVALID)], axis=1)
    repeats = np.concatenate([repeats, np.where(present.reshape(-1, 1), 0, _LUT_SIZE)], axis=1)
    by_value = torch.repeat_interleave(
        torch.from_numpy(entries.astype(np.int16).reshape(-1)).to(device),
        torch.from_numpy(repeats.reshape(-1)).to(device),
        output_size=len(headers) * symbols * _LUT_SIZE,
    )
    return by_value.view(-1, _LUT_SIZE)[:, _reversed_bits(device)].reshape(-1)


@triton.jit
def _decode_blocks(
    words_ptr,
    n_words,
    lut_ptr,
    context_ptr,
    z_ptr,
    lut_row_ptr,
    first_ptr,
    count_ptr,
    bit_ptr,
    end_ptr,
    fault_ptr,
    lanes,
    BLOCK_VALUES: tl.constexpr,
    LANES: tl.constexpr,
    FAULT_NO_TABLE: tl.constexpr,
    FAULT_BLOCKS: tl.constexpr,
):
    """One lane per block: decode its values' z from the stream words (int32, bits LSB
    first), starting at its bit, and record whether it ends where the block table says."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < lanes
    lut_row = tl.load(lut_row_ptr + lane, mask=live, other=0)
    first = tl.load(first_ptr + lane, mask=live, other=0)
    count = tl.load(count_ptr + lane, mask=live, other=0)
    pos = tl.load(bit_ptr + lane, mask=live, other=0)
    end = tl.load(end_ptr + lane, mask=live, other=0)
    no_table = tl.zeros([LANES], dtype=tl.int1)
    for i in range(BLOCK_VALUES):
        on = live & (i < count)
        word = pos >> 5
        lo = tl.load(words_ptr + word, mask=on & (word < n_words), other=0).to(tl.uint32, bitcast=True)
        hi = tl.load(words_ptr + word + 1, mask=on & (word + 1 < n_words), other=0).to(
            tl.uint32, bitcast=True
        )
        window = ((hi.to(tl.uint64) << 32) | lo.to(tl.uint64)) >> (pos & 31).to(tl.uint64)
        context = tl.load(context_ptr + first + i, mask=on, other=0).to(tl.int64)
        entry = tl.load(lut_ptr + (lut_row + context) * 4096 + (window & 4095).to(tl.int64), mask=on, other=0)
        entry = entry.to(tl.int32)
        no_table = no_table | (on & (entry < 0))
        entry = tl.where(entry < 0, 0, entry)
        symbol = entry & 0xFF
        n_code = entry >> 8
        n_raw = tl.maximum(symbol - 1, 0)
        raw_mask = (tl.full([LANES], 1, tl.uint64) << n_raw.to(tl.uint64)) - 1
        raw = ((window >> n_code.to(tl.uint64)) & raw_mask).to(tl.int32)
        z = tl.where(symbol >= 2, (1 << n_raw) | raw, symbol)
        tl.store(z_ptr + first + i, z, mask=on)
        pos += tl.where(on, n_code + n_raw, 0).to(tl.int64)
    fault = tl.where(no_table, FAULT_NO_TABLE, tl.where(pos != end, FAULT_BLOCKS, 0))
    tl.store(fault_ptr + lane, fault, mask=live)


def decode_bodies(
    parts: Sequence[LosslessPart],
    bodies: Sequence[torch.Tensor],
    dtype: torch.dtype,
    config: CodecConfig,
    wheres: Sequence[str],
) -> list[torch.Tensor]:
    """Each part's original values as a new (n, C) ``dtype`` tensor, decoded from its
    lossless body (``wheres`` name the parts in errors); CodecInputError, and nothing
    returned, if any body is corrupt."""
    device = parts[0].anchor.device
    fmt = lossless.word_format(dtype)
    model = _model(parts, dtype, config)
    sizes = [model.starts[i + 1] - model.starts[i] for i in range(len(parts))]
    prefix = [
        min(body.numel(), lossless.max_header_nbytes(n, fmt)) for body, n in zip(bodies, sizes, strict=True)
    ]
    # one copy to the host: each body's header and its last byte (the stream's padding)
    heads = torch.cat(
        [piece for body, n in zip(bodies, prefix, strict=True) for piece in (body[:n], body[-1:])]
    )
    host = heads.cpu().numpy().tobytes()
    raw_parts, coded_parts, headers = [], [], []
    at = 0
    for index, (body, length) in enumerate(zip(bodies, prefix, strict=True)):
        head, last, at = host[at : at + length], host[at + length], at + length + 1
        try:
            if head[0] == lossless.RAW:
                if body.numel() != lossless.max_body_nbytes(sizes[index], dtype):
                    raise CodecInputError(
                        f"corrupt lossless residual: a raw part body of {body.numel()} bytes "
                        f"for {sizes[index]} values"
                    )
                raw_parts.append(index)
            elif head[0] == lossless.CODED:
                header = lossless.read_header(head, body.numel(), sizes[index], fmt)
                stream_end = header.block_starts[-1]
                if stream_end % 8 and last >> (stream_end % 8):
                    raise CodecInputError("corrupt lossless residual: bytes or bits set past the last value")
                headers.append(header)
                coded_parts.append(index)
            else:
                raise CodecInputError(f"corrupt lossless residual: unknown part format {head[0]}")
        except CodecInputError as exc:
            raise CodecInputError(f"{exc} (in {wheres[index]})") from exc
    z = torch.zeros(model.starts[-1], dtype=torch.int32, device=device)
    # per part, how many values have each fault, in the order the CPU codec checks them
    fault_codes = (_FAULT_NO_TABLE, _FAULT_BLOCKS, _FAULT_RANGE, _FAULT_NON_FINITE)
    faults = {code: torch.zeros(len(parts), dtype=torch.int64, device=device) for code in fault_codes}
    words = torch.empty_like(z)
    if coded_parts:
        streams = torch.cat(
            [bodies[i][h.stream_at :] for i, h in zip(coded_parts, headers, strict=True)]
            + [torch.zeros(8, dtype=torch.uint8, device=device)]
        )
        streams = torch.nn.functional.pad(streams, (0, -streams.numel() % 4))
        lut = _lookup_tables(headers, fmt.symbols, device)
        lane_rows, lane_first, lane_count, lane_bit, lane_end = [], [], [], [], []
        part_lanes = np.zeros(len(parts), dtype=np.int64)
        stream_at = 0
        for row, (index, header) in enumerate(zip(coded_parts, headers, strict=True)):
            blocks = len(header.block_starts) - 1
            first = model.starts[index] + lossless.BLOCK_VALUES * np.arange(blocks)
            lane_rows.append(np.full(blocks, row * fmt.symbols))
            lane_first.append(first)
            lane_count.append(np.minimum(lossless.BLOCK_VALUES, model.starts[index + 1] - first))
            starts = 8 * stream_at + np.asarray(header.block_starts)
            lane_bit.append(starts[:-1])
            lane_end.append(starts[1:])
            part_lanes[index] = blocks
            stream_at += bodies[index].numel() - header.stream_at
        lanes = [
            torch.from_numpy(np.concatenate(a).astype(np.int64)).to(device)
            for a in (lane_rows, lane_first, lane_count, lane_bit, lane_end)
        ]
        lane_fault = torch.empty(lanes[0].numel(), dtype=torch.int32, device=device)
        _decode_blocks[(triton.cdiv(lane_fault.numel(), _LANES),)](
            streams.view(torch.int32),
            streams.numel() // 4,
            lut,
            model.contexts,
            z,
            *lanes,
            lane_fault,
            lane_fault.numel(),
            BLOCK_VALUES=lossless.BLOCK_VALUES,
            LANES=_LANES,
            FAULT_NO_TABLE=_FAULT_NO_TABLE,
            FAULT_BLOCKS=_FAULT_BLOCKS,
        )
        lane_starts = np.concatenate([[0], np.cumsum(part_lanes)]).tolist()
        for code in (_FAULT_NO_TABLE, _FAULT_BLOCKS):
            faults[code] = reference.range_counts(lane_fault == code, lane_starts)
        d = (z >> 1) ^ -(z & 1)
        ordinal = lossless.ordinals(model.anchor_words, fmt) + d
        words = lossless.words_of(ordinal, fmt)
        faults[_FAULT_RANGE] = reference.range_counts((ordinal < -0x8000) | (ordinal > 0x7FFF), model.starts)
    for index in raw_parts:
        start = model.starts[index]
        words[start : model.starts[index + 1]] = _words(bodies[index][1:].clone().view(dtype))
    exponent_field = ((1 << (fmt.word_bits - 1 - fmt.fraction_bits)) - 1) << fmt.fraction_bits
    faults[_FAULT_NON_FINITE] = reference.range_counts(
        (words & exponent_field) == exponent_field, model.starts
    )
    for index, counts in enumerate(torch.stack(list(faults.values()), 1).cpu().tolist()):
        fault = next((code for code, count in zip(fault_codes, counts, strict=True) if count), 0)
        if fault:
            raise CodecInputError(
                f"corrupt lossless residual of {wheres[index]}: {cpp_backend.RESIDUAL_FAULTS[fault]}"
            )
    signed = torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16).view(dtype)
    return [signed[model.starts[i] : model.starts[i + 1]].view(part.shape) for i, part in enumerate(parts)]
