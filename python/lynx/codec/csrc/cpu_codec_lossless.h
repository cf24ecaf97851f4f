// The lossless Residual of the fused CPU codec: the same bytes as lossless.py (which specifies
// the code), one part per task. Encode: the part's Anchor-only values (decode_unit), each
// value's context and symbol with a histogram, Huffman code lengths, then either the coded
// body (its size is known from the histogram before a bit is written) or the raw words.
// Decode: the Anchor-only values again, one table lookup per value (a table per context,
// indexed by as many bits as its longest code; two parts' serial loops interleaved), and
// every part checked before any pool row is written.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_codec_kernels.h"

namespace lynx_codec {

constexpr int kMaxCodeBits = 12;  // lossless.MAX_CODE_BITS
constexpr int64_t kBlockValues = 512;  // lossless.BLOCK_VALUES
constexpr uint8_t kRawBody = 0, kCodedBody = 1;

// Why a lossless part body was refused (index into cpp_backend.RESIDUAL_FAULTS).
enum ResidualFault : int64_t {
  kFaultNone = 0,
  kFaultLength,      // a body of another length than its content
  kFaultFormat,      // an unknown format byte
  kFaultTables,      // contexts out of order or range, or lengths that are no complete code
  kFaultNoTable,     // a value whose context has no table
  kFaultCode,        // a code that is in no table (never: every table is a complete code)
  kFaultRange,       // an ordinal out of the word range
  kFaultNonFinite,   // a NaN or infinite word
  kFaultPadding,     // bits set past the last value
  kFaultBlocks,      // a block whose values take other bits than the block table says
};

inline int64_t blocks_of(int64_t values) { return (values + kBlockValues - 1) / kBlockValues; }

// Huffman code lengths of one context's counts (lossless.code_lengths, the same choices);
// fixed-size arrays, no allocation (at most kMaxSymbols symbols).
constexpr int kMaxSymbols = 34;  // fp32: bit lengths 0..33
inline void code_lengths(const int64_t* counts, int symbols, uint8_t* lengths) {
  int used[kMaxSymbols];
  int n = 0;
  for (int s = 0; s < symbols; ++s) {
    lengths[s] = 0;
    if (counts[s] > 0) used[n++] = s;
  }
  if (n == 1) lengths[used[0]] = 1;
  if (n <= 1) return;
  int64_t weight[kMaxSymbols];
  for (int s = 0; s < symbols; ++s) weight[s] = counts[s];
  int leaves[kMaxSymbols];
  int64_t node_weight[2 * kMaxSymbols];
  int parent[2 * kMaxSymbols], depth[2 * kMaxSymbols];
  for (;;) {
    // leaves in (weight, symbol) order: a stable insertion sort of the symbol order
    for (int i = 0; i < n; ++i) {
      const int s = used[i];
      int j = i;
      for (; j > 0 && weight[leaves[j - 1]] > weight[s]; --j) leaves[j] = leaves[j - 1];
      leaves[j] = s;
    }
    int nodes = n;
    for (int i = 0; i < n; ++i) node_weight[i] = weight[leaves[i]], parent[i] = -1;
    int next_leaf = 0, next_merged = n;
    auto take = [&]() -> int {
      if (next_leaf < n && (next_merged >= nodes || node_weight[next_leaf] <= node_weight[next_merged]))
        return next_leaf++;
      return next_merged++;
    };
    for (int k = 0; k + 1 < n; ++k) {
      const int a = take(), b = take();
      parent[nodes] = -1;
      node_weight[nodes] = node_weight[a] + node_weight[b];
      parent[a] = parent[b] = nodes;
      ++nodes;
    }
    int longest = 0;
    depth[nodes - 1] = 0;
    for (int node = nodes - 2; node >= 0; --node) {
      depth[node] = depth[parent[node]] + 1;
      if (node < n) longest = std::max(longest, depth[node]);
    }
    if (longest <= kMaxCodeBits) {
      for (int i = 0; i < n; ++i) lengths[leaves[i]] = static_cast<uint8_t>(depth[i]);
      return;
    }
    for (int s = 0; s < symbols; ++s) weight[s] = (weight[s] + 1) / 2;
  }
}

// Canonical codes, bit-reversed over their lengths (lossless.canonical_codes).
inline void canonical_codes(const uint8_t* lengths, int symbols, uint16_t* codes) {
  uint32_t code = 0;
  int previous = 0;
  for (int length = 1; length <= kMaxCodeBits; ++length) {
    for (int s = 0; s < symbols; ++s) {
      if (lengths[s] != length) continue;
      code <<= length - previous;
      previous = length;
      uint32_t reversed = 0;
      for (int b = 0; b < length; ++b) reversed |= ((code >> b) & 1u) << (length - 1 - b);
      codes[s] = static_cast<uint16_t>(reversed);
      ++code;
    }
  }
}

// Whether the non-zero lengths form a complete prefix code (a single symbol: length 1).
inline bool complete_code(const uint8_t* lengths, int symbols) {
  int used = 0;
  int64_t kraft = 0;
  for (int s = 0; s < symbols; ++s) {
    if (!lengths[s]) continue;
    if (lengths[s] > kMaxCodeBits) return false;
    ++used;
    kraft += int64_t{1} << (kMaxCodeBits - lengths[s]);
  }
  if (used == 1) {
    for (int s = 0; s < symbols; ++s)
      if (lengths[s]) return lengths[s] == 1;
  }
  return used > 1 && kraft == (int64_t{1} << kMaxCodeBits);
}

template <typename D>
struct Lossless {
  using Word = typename D::Word;
  static constexpr int W = 8 * sizeof(Word);
  static constexpr int M = D::kFractionBits;
  static constexpr int kSymbols = W + 2;  // bit lengths 0..W+1, and as many contexts
  static constexpr int kKeys = kSymbols * kSymbols;  // (context, symbol) pairs
  static constexpr int kTableBytes = 1 + (kSymbols + 1) / 2;
  static constexpr uint32_t kExponentMask = (1u << (W - 1 - M)) - 1;
  // Longest code and raw bits of one value: at most 12 + W bits.
  static constexpr int kMaxValueBits = kMaxCodeBits + W;

  static int exponent(Word w) { return static_cast<int>((w >> M) & kExponentMask); }
  static int context(int scale_exponent, Word anchor) {
    return std::clamp(scale_exponent - exponent(anchor) + M, 0, kSymbols - 1);
  }
  // ordinal (lossless.ordinals) of a word read as a signed integer: a negative word's
  // magnitude bits flipped, -(w & ~sign) - 1, without a branch.
  static int64_t ordinal(Word w) {
    using Signed = std::make_signed_t<Word>;
    const Signed v = static_cast<Signed>(w);
    return static_cast<int64_t>(v ^ ((v >> (W - 1)) & static_cast<Signed>((Word(1) << (W - 1)) - 1)));
  }

  // Exponent field of each value's group scale, per group in wire group order.
  static void scale_exponents(const Part& p, const uint8_t* anchor, std::vector<uint8_t>& out) {
    const int64_t groups = p.per_channel ? (p.n + p.key_block - 1) / p.key_block * p.channels
                                         : p.n * (p.channels / p.group_size);
    const Word* scales = reinterpret_cast<const Word*>(anchor + p.scales_offset);
    out.resize(groups + 8);
    for (int64_t g = 0; g < groups; ++g) out[g] = static_cast<uint8_t>(exponent(scales[g]));
  }
  // The scale exponents of token t's row (index by channel >> shift).
  static const uint8_t* row_exponents(const Part& p, const std::vector<uint8_t>& exponents, int64_t t) {
    return exponents.data() + (p.per_channel ? t / p.key_block * p.channels : t * (p.channels / p.group_size));
  }
  static int channel_shift(const Part& p) { return p.per_channel ? 0 : __builtin_ctzll(p.group_size); }

  // Contexts of 8 values (int32 lanes) from their Anchor-only words (sign-extended int32
  // lanes) and the row's scale exponents (group_size >= 8: one group per 8 channels).
  static __m256i contexts8(__m256i a, const Part& p, const uint8_t* row_exponent, int64_t c, int shift) {
    const __m256i se =
        p.per_channel ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row_exponent + c)))
                      : _mm256_set1_epi32(row_exponent[c >> shift]);
    const __m256i ea = _mm256_and_si256(_mm256_srli_epi32(a, M), _mm256_set1_epi32(kExponentMask));
    const __m256i ctx = _mm256_sub_epi32(_mm256_add_epi32(se, _mm256_set1_epi32(M)), ea);
    return _mm256_min_epi32(_mm256_max_epi32(ctx, _mm256_setzero_si256()), _mm256_set1_epi32(kSymbols - 1));
  }
  // ordinal of 8 sign-extended 16-bit words in int32 lanes.
  static __m256i ordinals8(__m256i w) {
    return _mm256_xor_si256(w, _mm256_and_si256(_mm256_srai_epi32(w, 31), _mm256_set1_epi32(0x7FFF)));
  }
  static __m256i load_words8(const Word* w) {  // 16-bit words, sign-extended
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  }
};

// Per-thread buffers of the lossless coder, grown to the largest part (thread_local: kept
// from call to call).
template <typename D>
struct LosslessScratch {
  using Word = typename D::Word;
  using Z = std::conditional_t<sizeof(Word) == 2, uint32_t, uint64_t>;
  std::vector<Word> anchor;
  std::vector<uint16_t> key;   // encode: context * symbols + symbol per value
  std::vector<uint32_t> raw;   // encode: z without its leading bit
  std::vector<Z> z;            // decode: each value's z
  std::vector<uint8_t> context, scale_exponent, stream;
  std::vector<uint32_t> table;  // decode: the part's code tables, one after another
  std::vector<int64_t> block_end;  // decode: where each block's values end in the stream, in bits
  Scratch decode_scratch{0};
};

template <typename D>
LosslessScratch<D>& lossless_scratch() {
  static thread_local LosslessScratch<D> scratch;
  return scratch;
}

template <typename T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The Anchor-only values of a part, in element order, into s.anchor.
template <typename D>
void anchor_values(const Part& part, const uint8_t* anchor, LosslessScratch<D>& s) {
  Part p = part;
  p.slots = nullptr;
  grow(s.anchor, p.n * p.channels + 16);
  if (static_cast<int64_t>(s.decode_scratch.x.size()) < p.channels) s.decode_scratch = Scratch(p.channels);
  const DecodeJob<D> job{p, anchor, nullptr, s.anchor.data()};
  const int64_t units = (p.n + DecodeJob<D>::tokens_per_unit(p) - 1) / DecodeJob<D>::tokens_per_unit(p);
  for (int64_t unit = 0; unit < units; ++unit) decode_unit(job, unit, s.decode_scratch);
}

// Encode pass 1: each value's key (context * symbols + symbol) and raw bits (z less its
// leading bit), into s.key and s.raw.
template <typename D>
void encode_keys(const EncodeJob<D>& job, LosslessScratch<D>& s) {
  using L = Lossless<D>;
  using Word = typename D::Word;
  const Part& p = job.p;
  const int64_t C = p.channels;
  const int shift = L::channel_shift(p);
  for (int64_t t = 0; t < p.n; ++t) {
    const Word* x = job.rows + p.row(t) * C;
    const Word* a = s.anchor.data() + t * C;
    const uint8_t* row_exponent = L::row_exponents(p, s.scale_exponent, t);
    uint16_t* key = s.key.data() + t * C;
    uint32_t* raw = s.raw.data() + t * C;
    if constexpr (sizeof(Word) == 2) {
      for (int64_t c = 0; c < C; c += 8) {
        const __m256i wa = L::load_words8(a + c);
        const __m256i d = _mm256_sub_epi32(L::ordinals8(L::load_words8(x + c)), L::ordinals8(wa));
        const __m256i z = _mm256_xor_si256(_mm256_slli_epi32(d, 1), _mm256_srai_epi32(d, 31));  // < 2^17
        // bit length from the exponent of z as a float (exact); its leading bit likewise
        const __m256 fz = _mm256_cvtepi32_ps(z);
        const __m256i sym = _mm256_max_epi32(
            _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(fz), 23), _mm256_set1_epi32(126)),
            _mm256_setzero_si256());
        const __m256i lead =
            _mm256_cvttps_epi32(_mm256_and_ps(fz, _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0xFF800000u)))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(raw + c), _mm256_sub_epi32(z, lead));
        const __m256i ctx = L::contexts8(wa, p, row_exponent, c, shift);
        const __m256i k = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_slli_epi32(ctx, 4), _mm256_slli_epi32(ctx, 1)), sym);  // ctx * 18 + sym
        _mm_storeu_si128(reinterpret_cast<__m128i*>(key + c), narrow16(k));
      }
    } else {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t d = L::ordinal(x[c]) - L::ordinal(a[c]);
        const uint64_t z = (static_cast<uint64_t>(d) << 1) ^ static_cast<uint64_t>(d >> 63);
        const int sym = z ? 64 - __builtin_clzll(z) : 0;
        raw[c] = static_cast<uint32_t>(_bzhi_u64(z, sym - (sym > 0)));
        key[c] = static_cast<uint16_t>(L::context(row_exponent[c >> shift], a[c]) * L::kSymbols + sym);
      }
    }
  }
}

// Encode one part's lossless body into out (capacity 1 + n * C words), zeroing the rest of
// out; returns the body's length.
template <typename D>
int64_t encode_lossless_part(const EncodeJob<D>& job, LosslessScratch<D>& s) {
  using L = Lossless<D>;
  using Word = typename D::Word;
  const Part& p = job.p;
  const int64_t C = p.channels, values = p.n * C;
  const int64_t capacity = 1 + values * static_cast<int64_t>(sizeof(Word));
  uint8_t* out = job.residual;
  anchor_values<D>(p, job.anchor, s);
  L::scale_exponents(p, job.anchor, s.scale_exponent);
  grow(s.key, values + 8);
  grow(s.raw, values + 8);
  encode_keys(job, s);
  // histogram in four sub-tables (no store-to-load chain between neighbours)
  uint32_t sub[4][L::kKeys] = {};
  const uint16_t* key = s.key.data();
  int64_t i = 0;
  for (; i + 4 <= values; i += 4) {
    ++sub[0][key[i]];
    ++sub[1][key[i + 1]];
    ++sub[2][key[i + 2]];
    ++sub[3][key[i + 3]];
  }
  for (; i < values; ++i) ++sub[0][key[i]];
  int64_t counts[L::kKeys];
  for (int k = 0; k < L::kKeys; ++k) counts[k] = int64_t{sub[0][k]} + sub[1][k] + sub[2][k] + sub[3][k];
  uint8_t lengths[L::kKeys] = {};
  uint16_t codes[L::kKeys] = {};
  uint32_t emit[L::kKeys] = {};  // code | code bits << 16 | code and raw bits << 24
  int used_contexts = 0;
  int64_t bits = 0;
  for (int ctx = 0; ctx < L::kSymbols; ++ctx) {
    const int64_t* row = counts + ctx * L::kSymbols;
    int symbols = 0;
    for (int sym = 0; sym < L::kSymbols; ++sym) symbols += row[sym] > 0;
    if (!symbols) continue;
    ++used_contexts;
    uint8_t* len = lengths + ctx * L::kSymbols;
    uint16_t* code = codes + ctx * L::kSymbols;
    code_lengths(row, L::kSymbols, len);
    canonical_codes(len, L::kSymbols, code);
    for (int sym = 0; sym < L::kSymbols; ++sym) {
      const uint32_t n_code = symbols == 1 ? 0 : len[sym], n_raw = std::max(sym - 1, 0);
      emit[ctx * L::kSymbols + sym] = (n_code ? code[sym] : 0u) | n_code << 16 | (n_code + n_raw) << 24;
      bits += row[sym] * (n_code + n_raw);
    }
  }
  const int64_t blocks = blocks_of(values);
  const int64_t coded = 2 + used_contexts * L::kTableBytes + 2 * blocks + (bits + 7) / 8;
  if (coded >= capacity) {
    out[0] = kRawBody;
    for (int64_t t = 0; t < p.n; ++t) std::memcpy(out + 1 + t * C * sizeof(Word), job.rows + p.row(t) * C, C * sizeof(Word));
    return capacity;
  }
  out[0] = kCodedBody;
  out[1] = static_cast<uint8_t>(used_contexts);
  uint8_t* at = out + 2;
  for (int ctx = 0; ctx < L::kSymbols; ++ctx) {
    const uint8_t* len = lengths + ctx * L::kSymbols;
    bool any = false;
    for (int sym = 0; sym < L::kSymbols; ++sym) any |= len[sym] != 0;
    if (!any) continue;
    *at++ = static_cast<uint8_t>(ctx);
    for (int sym = 0; sym < L::kSymbols; sym += 2)
      *at++ = static_cast<uint8_t>(len[sym] | (sym + 1 < L::kSymbols ? len[sym + 1] << 4 : 0));
  }
  // the block table: each block's bits (< 2^16), little-endian
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t block = 0;
    for (int64_t j = b * kBlockValues, end = std::min(j + kBlockValues, values); j < end; ++j)
      block += emit[key[j]] >> 24;
    *at++ = static_cast<uint8_t>(block);
    *at++ = static_cast<uint8_t>(block >> 8);
  }
  // The bit stream, LSB-first, one 8-byte store per value into scratch (room past the end):
  // each value's code and raw bits are one field of at most 12 + 32 bits.
  const int64_t stream_bytes = (bits + 7) / 8;
  grow(s.stream, stream_bytes + 16);
  uint8_t* o = s.stream.data();
  const uint32_t* raw = s.raw.data();
  uint64_t acc = 0;
  uint32_t filled = 0;
  i = 0;
  if constexpr (2 * L::kMaxValueBits <= 56) {
    // 16-bit words: fields of 8 values in AVX2 (a gather of their emit entries), joined in
    // pairs of at most 2 * 28 bits, one store per pair
    for (; i + 8 <= values; i += 8) {
      const __m256i k = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + i)));
      const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(emit), k, 4);
      const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw + i));
      const __m256i n_code = _mm256_and_si256(_mm256_srli_epi32(e, 16), _mm256_set1_epi32(0xFF));
      const __m256i f = _mm256_or_si256(_mm256_and_si256(e, _mm256_set1_epi32(0xFFFF)), _mm256_sllv_epi32(r, n_code));
      const __m256i n = _mm256_srli_epi32(e, 24);
      const __m256i low = _mm256_set1_epi64x(0xFFFFFFFF);
      const __m256i n_even = _mm256_and_si256(n, low);
      const __m256i pair = _mm256_or_si256(_mm256_and_si256(f, low), _mm256_sllv_epi64(_mm256_srli_epi64(f, 32), n_even));
      const __m256i pair_bits = _mm256_add_epi64(n_even, _mm256_srli_epi64(n, 32));
      alignas(32) uint64_t fields[4], counts[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(fields), pair);
      _mm256_store_si256(reinterpret_cast<__m256i*>(counts), pair_bits);
      for (int j = 0; j < 4; ++j) {
        acc |= fields[j] << filled;
        filled += static_cast<uint32_t>(counts[j]);
        std::memcpy(o, &acc, 8);
        o += filled >> 3;
        acc >>= filled & 56;
        filled &= 7;
      }
    }
  }
  for (; i < values; ++i) {
    const uint32_t e = emit[key[i]];
    const uint64_t field = (e & 0xFFFFu) | (static_cast<uint64_t>(raw[i]) << ((e >> 16) & 0xFF));
    acc |= field << filled;
    filled += e >> 24;
    std::memcpy(o, &acc, 8);
    o += filled >> 3;
    acc >>= filled & 56;
    filled &= 7;
  }
  if (filled) std::memcpy(o, &acc, 8);  // the last partial byte (its high bits zero)
  std::memcpy(at, s.stream.data(), stream_bytes);
  std::memset(at + stream_bytes, 0, capacity - (at + stream_bytes - out));
  return coded;
}

// One part's decode between its phases: begin (tables, contexts), the serial loop (one
// table lookup per value, two parts interleaved so that their dependency chains overlap),
// end (trailing bits, words, range and non-finite checks).
template <typename D>
struct PartDecode {
  using L = Lossless<D>;
  using Z = typename LosslessScratch<D>::Z;
  int64_t fault = kFaultNone;
  bool coded = false;            // false: done in begin (a raw body, or a fault)
  int64_t values = 0, limit = 0;  // limit: the first value whose context has no table
  int64_t total_bits = 0, pos = 0, done = 0;  // total_bits: the stream's bytes * 8; done: values decoded
  const int64_t* block_end = nullptr;  // the block table, summed
  const uint8_t* stream = nullptr;
  const uint8_t* context = nullptr;
  Z* z = nullptr;
  // per context: its table and index width (its longest code; 0: a single symbol)
  const uint32_t* table[L::kSymbols];
  uint32_t width[L::kSymbols];
};

// Stream slack: the serial loop checks the position every kChunk values, and each block's
// end (blocks are whole chunks).
constexpr int64_t kChunk = 64;
static_assert(kBlockValues % kChunk == 0);

// Whether the values before end (a chunk's end) are a block's end at another position than
// the block table's.
template <typename D>
inline bool block_mismatch(const PartDecode<D>& d, int64_t end, int64_t pos) {
  return (end % kBlockValues == 0 || end == d.values) && pos != d.block_end[(end - 1) / kBlockValues];
}

template <typename D>
inline uint64_t peek_bits(const uint8_t* stream, int64_t pos) {
  uint64_t word;
  std::memcpy(&word, stream + (pos >> 3), 8);
  return word >> (pos & 7);  // >= 57 valid bits
}

// Decode value i of a part from bits (its first bit first); the value's bit count.
template <typename D>
inline uint32_t decode_one(const PartDecode<D>& d, int64_t i, uint64_t bits) {
  using Z = typename PartDecode<D>::Z;
  const int ctx = d.context[i];
  const uint32_t* t = d.table[ctx];
  const uint32_t e = t[_bzhi_u64(bits, d.width[ctx])];
  const uint32_t n_raw = (e >> 16) & 0xFF;
  d.z[i] = static_cast<Z>((static_cast<uint64_t>(e >> 24) << n_raw) | _bzhi_u64(bits >> ((e >> 8) & 0xF), n_raw));
  return e & 63;
}

// Values [i, end) of one part from position pos; the new position.
template <typename D>
inline int64_t decode_run(const PartDecode<D>& d, int64_t i, int64_t end, int64_t pos) {
  using L = Lossless<D>;
  if constexpr (2 * L::kMaxValueBits <= 57) {
    for (; i + 2 <= end; i += 2) {  // two values per 57 peeked bits
      const uint64_t bits = peek_bits<D>(d.stream, pos);
      const uint32_t n0 = decode_one(d, i, bits);
      const int64_t next = pos + n0;
      pos = next + decode_one(d, i + 1, bits >> n0);
    }
  }
  for (; i < end; ++i) pos += decode_one(d, i, peek_bits<D>(d.stream, pos));
  return pos;
}

// The serial loop of one part, from value d.done on.
template <typename D>
void decode_serial(PartDecode<D>& d) {
  int64_t pos = d.pos;
  for (int64_t first = d.done; first < d.limit; first += kChunk) {
    const int64_t end = std::min(first + kChunk, d.limit);
    pos = decode_run(d, first, end, pos);
    if (pos > d.total_bits) {  // the stream ends early
      d.fault = kFaultLength;
      return;
    }
    if (block_mismatch(d, end, pos)) {
      d.fault = kFaultBlocks;
      return;
    }
  }
  d.pos = pos;
  d.done = d.limit;
}

// Two parts' serial loops interleaved (independent chains), then each one's rest alone.
template <typename D>
void decode_serial2(PartDecode<D>& a, PartDecode<D>& b) {
  using L = Lossless<D>;
  const int64_t common = std::min(a.limit, b.limit) / kChunk * kChunk;
  int64_t pa = a.pos, pb = b.pos, first = 0;
  for (; first < common; first += kChunk) {
    const int64_t start_a = pa, start_b = pb;
    int64_t i = first;
    if constexpr (2 * L::kMaxValueBits <= 57) {
      for (; i < first + kChunk; i += 2) {
        const uint64_t bits_a = peek_bits<D>(a.stream, pa);
        const uint64_t bits_b = peek_bits<D>(b.stream, pb);
        const uint32_t na = decode_one(a, i, bits_a);
        const uint32_t nb = decode_one(b, i, bits_b);
        const int64_t next_a = pa + na, next_b = pb + nb;
        pa = next_a + decode_one(a, i + 1, bits_a >> na);
        pb = next_b + decode_one(b, i + 1, bits_b >> nb);
      }
    } else {
      for (; i < first + kChunk; ++i) {
        const uint64_t bits_a = peek_bits<D>(a.stream, pa);
        const uint64_t bits_b = peek_bits<D>(b.stream, pb);
        pa += decode_one(a, i, bits_a);
        pb += decode_one(b, i, bits_b);
      }
    }
    if (pa > a.total_bits || pb > b.total_bits || block_mismatch(a, first + kChunk, pa) ||
        block_mismatch(b, first + kChunk, pb)) {  // an early end or a block's: both redo this chunk alone
      pa = start_a, pb = start_b;
      break;
    }
  }
  a.pos = pa, b.pos = pb, a.done = b.done = first;
  decode_serial(a);
  decode_serial(b);
}

// Phase 1 of one part's lossless body: a raw body whole, else its tables, each value's
// context and the stream (into s); d.fault a ResidualFault.
template <typename D>
void decode_begin(const Part& p, const uint8_t* anchor, const uint8_t* body, int64_t length, typename D::Word* out,
                  LosslessScratch<D>& s, PartDecode<D>& d) {
  using L = Lossless<D>;
  using Word = typename D::Word;
  const int64_t C = p.channels, values = p.n * C;
  d = PartDecode<D>{};
  d.values = values;
  if (length < 1) {
    d.fault = kFaultLength;
    return;
  }
  if (body[0] == kRawBody) {
    if (length != 1 + values * static_cast<int64_t>(sizeof(Word))) {
      d.fault = kFaultLength;
      return;
    }
    std::memcpy(out, body + 1, values * sizeof(Word));
    bool non_finite = false;
    for (int64_t i = 0; i < values; ++i) non_finite |= D::non_finite(out[i]);
    d.fault = non_finite ? kFaultNonFinite : kFaultNone;
    return;
  }
  if (body[0] != kCodedBody) {
    d.fault = kFaultFormat;
    return;
  }
  if (length < 2) {
    d.fault = kFaultLength;
    return;
  }
  const int count = body[1];
  int64_t at = 2;
  // Per context its table (offset into s.table; 2^width entries). Entry: code and raw bits
  // (bits 0-5), code bits (8-11), raw bits (16-21), bit 24: whether z has a leading bit
  // (symbol > 0). Entry 0 stands in for contexts without a table (never looked up).
  uint32_t offset[L::kSymbols];
  uint64_t has_table = 0;  // bit per context (fp32: 34 of them)
  uint32_t table_size = 1;
  uint8_t lens[L::kSymbols][L::kSymbols];
  int previous = -1;
  for (int k = 0; k < count; ++k) {
    if (at + L::kTableBytes > length) {
      d.fault = kFaultLength;
      return;
    }
    const int ctx = body[at];
    uint8_t* len = lens[ctx < L::kSymbols ? ctx : 0];
    if (ctx <= previous || ctx >= L::kSymbols) {
      d.fault = kFaultTables;
      return;
    }
    for (int sym = 0; sym < L::kSymbols; ++sym) len[sym] = (body[at + 1 + sym / 2] >> (4 * (sym % 2))) & 0xF;
    if (((L::kSymbols % 2) && (body[at + L::kTableBytes - 1] >> 4)) || !complete_code(len, L::kSymbols)) {
      d.fault = kFaultTables;
      return;
    }
    int used = 0, longest = 0;
    for (int sym = 0; sym < L::kSymbols; ++sym)
      if (len[sym]) ++used, longest = std::max<int>(longest, len[sym]);
    d.width[ctx] = used == 1 ? 0 : longest;
    has_table |= uint64_t{1} << ctx;
    offset[ctx] = table_size;
    table_size += 1u << d.width[ctx];
    previous = ctx;
    at += L::kTableBytes;
  }
  // the block table: the stream must be as long as it says
  const int64_t blocks = blocks_of(values);
  if (at + 2 * blocks > length) {
    d.fault = kFaultLength;
    return;
  }
  grow(s.block_end, blocks);
  int64_t stream_end = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    stream_end += body[at + 2 * b] | body[at + 2 * b + 1] << 8;
    s.block_end[b] = stream_end;
  }
  at += 2 * blocks;
  if (length - at != (stream_end + 7) / 8) {
    d.fault = kFaultLength;
    return;
  }
  grow(s.table, table_size);
  uint32_t* table = s.table.data();
  table[0] = 0;
  for (int ctx = 0; ctx < L::kSymbols; ++ctx) {
    if (!(has_table >> ctx & 1)) {
      d.table[ctx] = table;
      d.width[ctx] = 0;
      continue;
    }
    const uint8_t* len = lens[ctx];
    uint32_t* t = table + offset[ctx];
    d.table[ctx] = t;
    const int width = d.width[ctx];
    uint16_t code[L::kSymbols];
    canonical_codes(len, L::kSymbols, code);
    for (int sym = 0; sym < L::kSymbols; ++sym) {
      if (!len[sym]) continue;
      const uint32_t n_code = width ? len[sym] : 0, n_raw = std::max(sym - 1, 0);
      const uint32_t entry = (n_code + n_raw) | n_code << 8 | n_raw << 16 | uint32_t{sym > 0} << 24;
      if (!width) {
        t[0] = entry;
        continue;
      }
      for (uint32_t high = 0; high < (1u << (width - len[sym])); ++high) t[code[sym] | (high << len[sym])] = entry;
    }
  }
  // each value's context, and the first value whose context has no table
  anchor_values<D>(p, anchor, s);
  L::scale_exponents(p, anchor, s.scale_exponent);
  grow(s.context, values + 32);
  int64_t limit = values;
  const int shift = L::channel_shift(p);
  for (int64_t t = 0; t < p.n && limit == values; ++t) {
    const Word* a = s.anchor.data() + t * C;
    const uint8_t* row_exponent = L::row_exponents(p, s.scale_exponent, t);
    uint8_t* context = s.context.data() + t * C;
    if constexpr (sizeof(Word) == 2) {
      const __m256i has_lo = _mm256_set1_epi32(static_cast<int32_t>(has_table));
      for (int64_t c = 0; c < C; c += 8) {
        const __m256i ctx = L::contexts8(L::load_words8(a + c), p, row_exponent, c, shift);
        const __m128i bytes = narrow16(ctx);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(context + c), _mm_packus_epi16(bytes, bytes));
        const __m256i has = _mm256_slli_epi32(_mm256_srlv_epi32(has_lo, ctx), 31);  // kSymbols <= 32
        const uint32_t missing = ~static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(has))) & 0xFF;
        if (missing) {
          limit = t * C + c + __builtin_ctz(missing);
          break;
        }
      }
    } else {
      for (int64_t c = 0; c < C; ++c) {
        const int ctx = L::context(row_exponent[c >> shift], a[c]);
        context[c] = static_cast<uint8_t>(ctx);
        if (!(has_table >> ctx & 1)) {
          limit = t * C + c;
          break;
        }
      }
    }
  }
  const int64_t stream_bytes = length - at;
  const int64_t slack = kChunk * L::kMaxValueBits / 8 + 16;
  grow(s.stream, stream_bytes + slack);
  std::memcpy(s.stream.data(), body + at, stream_bytes);
  std::memset(s.stream.data() + stream_bytes, 0, slack);
  grow(s.z, values + 16);
  d.coded = true;
  d.limit = limit;
  d.total_bits = 8 * stream_bytes;
  d.block_end = s.block_end.data();
  d.stream = s.stream.data();
  d.context = s.context.data();
  d.z = s.z.data();
}

// Phase 3: after the serial loop, the trailing bits, then the words (ordinal of the
// Anchor-only word + d; out of range, then non-finite, refused); d.fault.
template <typename D>
void decode_end(const LosslessScratch<D>& s, typename D::Word* out, PartDecode<D>& d) {
  using L = Lossless<D>;
  using Word = typename D::Word;
  if (!d.coded || d.fault) return;
  const int64_t values = d.values, pos = d.pos, total_bits = d.total_bits;
  if (d.limit < values) {
    d.fault = kFaultNoTable;
    return;
  }
  if (pos < total_bits && (peek_bits<D>(d.stream, pos) & ((uint64_t{1} << (total_bits - pos)) - 1))) {
    d.fault = kFaultPadding;
    return;
  }
  const Word* a = s.anchor.data();
  const auto* zs = d.z;
  if constexpr (sizeof(Word) == 2) {
    __m256i out_of_range = _mm256_setzero_si256(), non_finite = _mm256_setzero_si256();
    const __m256i field = _mm256_set1_epi32(static_cast<int32_t>(L::kExponentMask << L::M));
    for (int64_t i = 0; i < values; i += 8) {
      const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(zs + i));
      const __m256i d8 = _mm256_xor_si256(
          _mm256_srli_epi32(z, 1), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_and_si256(z, _mm256_set1_epi32(1))));
      const __m256i o = _mm256_add_epi32(L::ordinals8(L::load_words8(a + i)), d8);
      out_of_range = _mm256_or_si256(out_of_range, _mm256_or_si256(_mm256_cmpgt_epi32(o, _mm256_set1_epi32(0x7FFF)),
                                                                   _mm256_cmpgt_epi32(_mm256_set1_epi32(-0x8000), o)));
      const __m256i w = _mm256_and_si256(L::ordinals8(o), _mm256_set1_epi32(0xFFFF));
      non_finite = _mm256_or_si256(non_finite, _mm256_cmpeq_epi32(_mm256_and_si256(w, field), field));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), narrow16(w));
    }
    if (!_mm256_testz_si256(out_of_range, out_of_range)) d.fault = kFaultRange;
    else if (!_mm256_testz_si256(non_finite, non_finite)) d.fault = kFaultNonFinite;
  } else {
    constexpr int64_t kHalf = int64_t{1} << (L::W - 1);
    bool out_of_range = false, non_finite = false;
    for (int64_t i = 0; i < values; ++i) {
      const uint64_t z = zs[i];
      const int64_t dv = static_cast<int64_t>(z >> 1) ^ -static_cast<int64_t>(z & 1);
      const int64_t o = L::ordinal(a[i]) + dv;
      out_of_range |= (o < -kHalf) | (o >= kHalf);
      const Word w = static_cast<Word>(o ^ ((o >> 63) & (kHalf - 1)));
      non_finite |= D::non_finite(w);
      out[i] = w;
    }
    if (out_of_range) d.fault = kFaultRange;
    else if (non_finite) d.fault = kFaultNonFinite;
  }
}

// Lossless bodies of several parts (their Anchors already encoded), one task per part; per
// part the body's length.
template <typename D>
std::vector<int64_t> encode_lossless_parts(const std::vector<EncodeJob<D>>& jobs, const std::vector<bool>& finite,
                                           int threads) {
  std::vector<int64_t> used(jobs.size(), -1);
  const int64_t count = static_cast<int64_t>(jobs.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i)
    if (finite[i]) used[i] = encode_lossless_part(jobs[i], lossless_scratch<D>());
  return used;
}

// Decode several parts' lossless bodies and, only if every one is sound, write them into
// their rows[slots]; per part a ResidualFault. A task is two parts (their serial loops
// interleaved).
template <typename D>
std::vector<int64_t> decode_lossless_parts(const std::vector<DecodeJob<D>>& jobs, const std::vector<int64_t>& lengths,
                                           int threads) {
  using Word = typename D::Word;
  const int64_t count = static_cast<int64_t>(jobs.size());
  std::vector<int64_t> faults(count, kFaultNone), offsets(count + 1, 0);
  for (int64_t i = 0; i < count; ++i) offsets[i + 1] = offsets[i] + (jobs[i].p.n * jobs[i].p.channels + 15) / 16 * 16;
  static thread_local std::vector<Word> decoded;  // every part's words, until all are found sound
  grow(decoded, offsets[count]);
  Word* words = decoded.data();
  const int64_t pairs = (count + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t pair = 0; pair < pairs; ++pair) {
    static thread_local LosslessScratch<D> scratch[2];
    PartDecode<D> d[2];
    const int64_t first = 2 * pair, n = std::min<int64_t>(2, count - first);
    for (int64_t k = 0; k < n; ++k) {
      const DecodeJob<D>& job = jobs[first + k];
      decode_begin<D>(job.p, job.anchor, job.residual, lengths[first + k], words + offsets[first + k], scratch[k], d[k]);
    }
    const bool run0 = d[0].coded && !d[0].fault, run1 = n == 2 && d[1].coded && !d[1].fault;
    if (run0 && run1) {
      decode_serial2(d[0], d[1]);
    } else if (run0) {
      decode_serial(d[0]);
    } else if (run1) {
      decode_serial(d[1]);
    }
    for (int64_t k = 0; k < n; ++k) {
      decode_end(scratch[k], words + offsets[first + k], d[k]);
      faults[first + k] = d[k].fault;
    }
  }
  for (int64_t fault : faults)
    if (fault) return faults;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) {
    const Part& p = jobs[i].p;
    for (int64_t t = 0; t < p.n; ++t)
      std::memcpy(jobs[i].rows + p.row(t) * p.channels, words + offsets[i] + t * p.channels, p.channels * sizeof(Word));
  }
  return faults;
}

}  // namespace lynx_codec
