// The lossless Residual of the fused CPU codec: the same bytes as lossless.py (which specifies
// the code), one part per task. Encode: the part's Anchor-only values (decode_unit), each
// value's context and symbol with a histogram, Huffman code lengths, then either the coded
// body (its size is known from the histogram before a bit is written) or the raw words.
// Decode: the Anchor-only values again, one 4096-entry table lookup per code, and every part
// checked before any pool row is written.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_codec_kernels.h"

namespace lynx_codec {

constexpr int kMaxCodeBits = 12;  // lossless.MAX_CODE_BITS
constexpr uint8_t kRawBody = 0, kCodedBody = 1;

// Why a lossless part body was refused (index into cpp_backend.RESIDUAL_FAULTS).
enum ResidualFault : int64_t {
  kFaultNone = 0,
  kFaultLength,      // a body of another length than its content
  kFaultFormat,      // an unknown format byte
  kFaultTables,      // contexts out of order or range, or lengths that are no complete code
  kFaultNoTable,     // a value whose context has no table
  kFaultCode,        // a code that is in no table
  kFaultRange,       // an ordinal out of the word range
  kFaultNonFinite,   // a NaN or infinite word
  kFaultPadding,     // bits set past the last value
};

// Huffman code lengths of one context's counts (lossless.code_lengths, the same choices).
inline void code_lengths(const int64_t* counts, int symbols, uint8_t* lengths) {
  std::vector<int> used;
  for (int s = 0; s < symbols; ++s) {
    lengths[s] = 0;
    if (counts[s] > 0) used.push_back(s);
  }
  if (used.size() == 1) lengths[used[0]] = 1;
  if (used.size() <= 1) return;
  std::vector<int64_t> weight(counts, counts + symbols);
  const size_t n = used.size();
  std::vector<int> leaves(used);
  std::vector<int64_t> node_weight;
  std::vector<int> parent, depth;
  for (;;) {
    std::stable_sort(leaves.begin(), leaves.end(), [&](int a, int b) { return weight[a] < weight[b]; });
    node_weight.clear();
    for (int s : leaves) node_weight.push_back(weight[s]);
    parent.assign(n, -1);
    size_t next_leaf = 0, next_merged = n;
    auto take = [&]() -> size_t {
      if (next_leaf < n && (next_merged >= node_weight.size() || node_weight[next_leaf] <= node_weight[next_merged]))
        return next_leaf++;
      return next_merged++;
    };
    for (size_t k = 0; k + 1 < n; ++k) {
      const size_t a = take(), b = take();
      parent.push_back(-1);
      node_weight.push_back(node_weight[a] + node_weight[b]);
      parent[a] = parent[b] = static_cast<int>(node_weight.size() - 1);
    }
    depth.assign(node_weight.size(), 0);
    int longest = 0;
    for (int node = static_cast<int>(node_weight.size()) - 2; node >= 0; --node) {
      depth[node] = depth[parent[node]] + 1;
      if (static_cast<size_t>(node) < n) longest = std::max(longest, depth[node]);
    }
    if (longest <= kMaxCodeBits) {
      for (size_t i = 0; i < n; ++i) lengths[leaves[i]] = static_cast<uint8_t>(depth[i]);
      return;
    }
    for (int64_t& w : weight) w = (w + 1) / 2;
    std::sort(leaves.begin(), leaves.end());  // the order (count, symbol) is rebuilt from symbol order
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
  static constexpr int kTableBytes = 1 + (kSymbols + 1) / 2;
  static constexpr uint32_t kExponentMask = (1u << (W - 1 - M)) - 1;

  static int64_t ordinal(Word w) {
    const Word sign = Word(1) << (W - 1);
    return (w & sign) ? -static_cast<int64_t>(w & Word(sign - 1)) - 1 : static_cast<int64_t>(w);
  }
  static Word word_of(int64_t o) {
    const Word sign = Word(1) << (W - 1);
    return o < 0 ? static_cast<Word>((-o - 1) | sign) : static_cast<Word>(o);
  }
  static int exponent(Word w) { return static_cast<int>((w >> M) & kExponentMask); }
  static int context(int scale_exponent, Word anchor) {
    return std::clamp(scale_exponent - exponent(anchor) + M, 0, kSymbols - 1);
  }
  static int bit_length(uint64_t z) { return z ? 64 - __builtin_clzll(z) : 0; }

  // Exponent field of each value's group scale, per group in wire group order.
  static void scale_exponents(const Part& p, const uint8_t* anchor, std::vector<uint8_t>& out) {
    const int64_t groups = p.per_channel ? (p.n + p.key_block - 1) / p.key_block * p.channels
                                         : p.n * (p.channels / p.group_size);
    const Word* scales = reinterpret_cast<const Word*>(anchor + p.scales_offset);
    out.resize(groups);
    for (int64_t g = 0; g < groups; ++g) out[g] = static_cast<uint8_t>(exponent(scales[g]));
  }
  // The scale exponents of token t's row (index by channel >> shift).
  static const uint8_t* row_exponents(const Part& p, const std::vector<uint8_t>& exponents, int64_t t) {
    return exponents.data() + (p.per_channel ? t / p.key_block * p.channels : t * (p.channels / p.group_size));
  }
  static int channel_shift(const Part& p) { return p.per_channel ? 0 : __builtin_ctzll(p.group_size); }
};

// Per-thread buffers of the lossless coder, grown to the largest part.
template <typename D>
struct LosslessScratch {
  using Word = typename D::Word;
  std::vector<Word> anchor, out;
  std::vector<uint8_t> context, symbol, scale_exponent, stream;
  std::vector<uint16_t> table;  // decode: per context 4096 entries of symbol | length << 8
  Scratch decode_scratch{0};
};

// The Anchor-only values of a part, in element order, into s.anchor.
template <typename D>
void anchor_values(const Part& part, const uint8_t* anchor, LosslessScratch<D>& s) {
  Part p = part;
  p.slots = nullptr;
  s.anchor.resize(p.n * p.channels);
  if (static_cast<int64_t>(s.decode_scratch.x.size()) < p.channels) s.decode_scratch = Scratch(p.channels);
  const DecodeJob<D> job{p, anchor, nullptr, s.anchor.data()};
  const int64_t units = (p.n + DecodeJob<D>::tokens_per_unit(p) - 1) / DecodeJob<D>::tokens_per_unit(p);
  for (int64_t unit = 0; unit < units; ++unit) decode_unit(job, unit, s.decode_scratch);
}

// LSB-first bit writer into a buffer known to be large enough.
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  void put(uint64_t bits, int count) {  // count <= 32
    acc_ |= bits << filled_;
    filled_ += count;
    if (filled_ >= 32) {
      const uint32_t low = static_cast<uint32_t>(acc_);
      std::memcpy(out_, &low, 4);
      out_ += 4;
      acc_ >>= 32;
      filled_ -= 32;
    }
  }
  void finish() {
    while (filled_ > 0) {
      *out_++ = static_cast<uint8_t>(acc_);
      acc_ >>= 8;
      filled_ -= 8;
    }
  }

 private:
  uint8_t* out_;
  uint64_t acc_ = 0;
  int filled_ = 0;
};

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
  s.context.resize(values);
  s.symbol.resize(values);
  std::array<int64_t, L::kSymbols * L::kSymbols> counts{};
  const int shift = L::channel_shift(p);
  for (int64_t t = 0; t < p.n; ++t) {
    const Word* x = job.rows + p.row(t) * C;
    const Word* a = s.anchor.data() + t * C;
    const uint8_t* scale_exponent = L::row_exponents(p, s.scale_exponent, t);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t d = L::ordinal(x[c]) - L::ordinal(a[c]);
      const uint64_t z = d >= 0 ? static_cast<uint64_t>(2 * d) : static_cast<uint64_t>(-2 * d - 1);
      const int sym = L::bit_length(z);
      const int ctx = L::context(scale_exponent[c >> shift], a[c]);
      s.context[t * C + c] = static_cast<uint8_t>(ctx);
      s.symbol[t * C + c] = static_cast<uint8_t>(sym);
      ++counts[ctx * L::kSymbols + sym];
    }
  }
  std::array<uint8_t, L::kSymbols * L::kSymbols> lengths{};
  std::array<uint16_t, L::kSymbols * L::kSymbols> codes{};
  int used_contexts = 0;
  int64_t bits = 0;
  std::array<std::array<uint8_t, L::kSymbols>, L::kSymbols> emit_bits{};
  for (int ctx = 0; ctx < L::kSymbols; ++ctx) {
    const int64_t* row = counts.data() + ctx * L::kSymbols;
    int symbols = 0;
    for (int sym = 0; sym < L::kSymbols; ++sym) symbols += row[sym] > 0;
    if (!symbols) continue;
    ++used_contexts;
    uint8_t* len = lengths.data() + ctx * L::kSymbols;
    code_lengths(row, L::kSymbols, len);
    canonical_codes(len, L::kSymbols, codes.data() + ctx * L::kSymbols);
    for (int sym = 0; sym < L::kSymbols; ++sym) {
      emit_bits[ctx][sym] = symbols == 1 ? 0 : len[sym];
      bits += row[sym] * (emit_bits[ctx][sym] + std::max(sym - 1, 0));
    }
  }
  const int64_t coded = 2 + used_contexts * L::kTableBytes + (bits + 7) / 8;
  if (coded >= capacity) {
    out[0] = kRawBody;
    for (int64_t t = 0; t < p.n; ++t) std::memcpy(out + 1 + t * C * sizeof(Word), job.rows + p.row(t) * C, C * sizeof(Word));
    return capacity;
  }
  out[0] = kCodedBody;
  out[1] = static_cast<uint8_t>(used_contexts);
  uint8_t* at = out + 2;
  for (int ctx = 0; ctx < L::kSymbols; ++ctx) {
    const uint8_t* len = lengths.data() + ctx * L::kSymbols;
    bool any = false;
    for (int sym = 0; sym < L::kSymbols; ++sym) any |= len[sym] != 0;
    if (!any) continue;
    *at++ = static_cast<uint8_t>(ctx);
    for (int sym = 0; sym < L::kSymbols; sym += 2)
      *at++ = static_cast<uint8_t>(len[sym] | (sym + 1 < L::kSymbols ? len[sym + 1] << 4 : 0));
  }
  std::memset(at, 0, capacity - (at - out));
  BitWriter writer(at);
  for (int64_t t = 0; t < p.n; ++t) {
    const Word* x = job.rows + p.row(t) * C;
    const Word* a = s.anchor.data() + t * C;
    for (int64_t c = 0; c < C; ++c) {
      const int ctx = s.context[t * C + c], sym = s.symbol[t * C + c];
      const int n_code = emit_bits[ctx][sym];
      if (n_code) writer.put(codes[ctx * L::kSymbols + sym], n_code);
      if (sym >= 2) {
        const int64_t d = L::ordinal(x[c]) - L::ordinal(a[c]);
        const uint64_t z = d >= 0 ? static_cast<uint64_t>(2 * d) : static_cast<uint64_t>(-2 * d - 1);
        writer.put(z - (uint64_t{1} << (sym - 1)), sym - 1);  // sym - 1 <= W: at most 32 bits
      }
    }
  }
  writer.finish();
  return coded;
}

// Decode one part's lossless body into s.out (element order); a ResidualFault.
template <typename D>
int64_t decode_lossless_part(const Part& p, const uint8_t* anchor, const uint8_t* body, int64_t length,
                             LosslessScratch<D>& s) {
  using L = Lossless<D>;
  using Word = typename D::Word;
  const int64_t C = p.channels, values = p.n * C;
  s.out.resize(values);
  if (length < 1) return kFaultLength;
  if (body[0] == kRawBody) {
    if (length != 1 + values * static_cast<int64_t>(sizeof(Word))) return kFaultLength;
    std::memcpy(s.out.data(), body + 1, values * sizeof(Word));
    for (int64_t i = 0; i < values; ++i)
      if (D::non_finite(s.out[i])) return kFaultNonFinite;
    return kFaultNone;
  }
  if (body[0] != kCodedBody) return kFaultFormat;
  if (length < 2) return kFaultLength;
  const int count = body[1];
  int64_t at = 2;
  // per context: -2 no table, -1 a table, else its single symbol
  std::array<int, L::kSymbols> single;
  single.fill(-2);
  s.table.assign(static_cast<size_t>(L::kSymbols) << kMaxCodeBits, 0);
  int previous = -1;
  for (int k = 0; k < count; ++k) {
    if (at + L::kTableBytes > length) return kFaultLength;
    const int ctx = body[at];
    if (ctx <= previous || ctx >= L::kSymbols) return kFaultTables;
    uint8_t len[L::kSymbols];
    for (int sym = 0; sym < L::kSymbols; ++sym) len[sym] = (body[at + 1 + sym / 2] >> (4 * (sym % 2))) & 0xF;
    if ((L::kSymbols % 2) && (body[at + L::kTableBytes - 1] >> 4)) return kFaultTables;
    if (!complete_code(len, L::kSymbols)) return kFaultTables;
    int used = 0, only = 0;
    for (int sym = 0; sym < L::kSymbols; ++sym)
      if (len[sym]) ++used, only = sym;
    if (used == 1) {
      single[ctx] = only;
    } else {
      single[ctx] = -1;
      uint16_t code[L::kSymbols];
      canonical_codes(len, L::kSymbols, code);
      uint16_t* table = s.table.data() + (static_cast<size_t>(ctx) << kMaxCodeBits);
      for (int sym = 0; sym < L::kSymbols; ++sym) {
        if (!len[sym]) continue;
        const uint16_t entry = static_cast<uint16_t>(sym | (len[sym] << 8));
        for (uint32_t high = 0; high < (1u << (kMaxCodeBits - len[sym])); ++high)
          table[code[sym] | (high << len[sym])] = entry;
      }
    }
    previous = ctx;
    at += L::kTableBytes;
  }
  const int64_t stream_bytes = length - at;
  s.stream.assign(stream_bytes + 16, 0);
  std::memcpy(s.stream.data(), body + at, stream_bytes);
  const int64_t total_bits = 8 * stream_bytes;
  const uint8_t* stream = s.stream.data();
  auto peek = [&](int64_t pos) {
    uint64_t word;
    std::memcpy(&word, stream + (pos >> 3), 8);
    return word >> (pos & 7);  // >= 57 valid bits
  };
  anchor_values<D>(p, anchor, s);
  L::scale_exponents(p, anchor, s.scale_exponent);
  constexpr int64_t kHalf = int64_t{1} << (L::W - 1);
  const int shift = L::channel_shift(p);
  int64_t pos = 0;
  for (int64_t t = 0; t < p.n; ++t) {
    const Word* a = s.anchor.data() + t * C;
    const uint8_t* scale_exponent = L::row_exponents(p, s.scale_exponent, t);
    Word* dst = s.out.data() + t * C;
    for (int64_t c = 0; c < C; ++c) {
      const int ctx = L::context(scale_exponent[c >> shift], a[c]);
      int sym = single[ctx];
      if (sym == -2) return kFaultNoTable;
      uint64_t bits = peek(pos);
      if (sym == -1) {
        const uint16_t entry = s.table[(static_cast<size_t>(ctx) << kMaxCodeBits) | (bits & ((1u << kMaxCodeBits) - 1))];
        if (!entry) return kFaultCode;
        sym = entry & 0xFF;
        const int n_code = entry >> 8;
        pos += n_code;
        bits >>= n_code;
      }
      uint64_t z = static_cast<uint64_t>(sym);
      if (sym >= 2) {
        const int raw = sym - 1;  // at most W <= 32 bits, within the 57 peeked
        z = (uint64_t{1} << raw) + (peek(pos) & ((uint64_t{1} << raw) - 1));
        pos += raw;
      }
      if (pos > total_bits) return kFaultLength;
      const int64_t d = (z & 1) ? -static_cast<int64_t>((z + 1) >> 1) : static_cast<int64_t>(z >> 1);
      const int64_t o = L::ordinal(a[c]) + d;
      if (o < -kHalf || o >= kHalf) return kFaultRange;
      const Word w = L::word_of(o);
      if (D::non_finite(w)) return kFaultNonFinite;
      dst[c] = w;
    }
  }
  if (total_bits - pos >= 8) return kFaultLength;
  if (pos < total_bits && (peek(pos) & ((uint64_t{1} << (total_bits - pos)) - 1))) return kFaultPadding;
  return kFaultNone;
}

// Lossless bodies of several parts (their Anchors already encoded), one task per part; per
// part the body's length.
template <typename D>
std::vector<int64_t> encode_lossless_parts(const std::vector<EncodeJob<D>>& jobs, const std::vector<bool>& finite,
                                           int threads) {
  std::vector<int64_t> used(jobs.size(), -1);
  const int64_t count = static_cast<int64_t>(jobs.size());
#pragma omp parallel num_threads(threads)
  {
    LosslessScratch<D> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i)
      if (finite[i]) used[i] = encode_lossless_part(jobs[i], scratch);
  }
  return used;
}

// Decode several parts' lossless bodies and, only if every one is sound, write them into
// their rows[slots]; per part a ResidualFault.
template <typename D>
std::vector<int64_t> decode_lossless_parts(const std::vector<DecodeJob<D>>& jobs, const std::vector<int64_t>& lengths,
                                           int threads) {
  const int64_t count = static_cast<int64_t>(jobs.size());
  std::vector<int64_t> faults(count, kFaultNone);
  std::vector<std::vector<typename D::Word>> decoded(count);
#pragma omp parallel num_threads(threads)
  {
    LosslessScratch<D> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      faults[i] = decode_lossless_part<D>(jobs[i].p, jobs[i].anchor, jobs[i].residual, lengths[i], scratch);
      decoded[i].swap(scratch.out);
    }
  }
  for (int64_t fault : faults)
    if (fault) return faults;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < count; ++i) {
    const Part& p = jobs[i].p;
    for (int64_t t = 0; t < p.n; ++t)
      std::memcpy(jobs[i].rows + p.row(t) * p.channels, decoded[i].data() + t * p.channels,
                  p.channels * sizeof(typename D::Word));
  }
  return faults;
}

}  // namespace lynx_codec
