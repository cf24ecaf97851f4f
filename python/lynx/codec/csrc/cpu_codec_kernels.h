// Kernels of the fused CPU codec, free of torch (bindings in cpu_codec.cpp). The math and
// byte layout are those of format.py, float32 operations in exactly its order; built with
// -ffp-contract=off and without -ffast-math so every operation rounds as in the torch
// reference (the one fused multiply-add, in divide_by_reciprocal, is an explicit intrinsic).
// Encode is AVX2/FMA/F16C intrinsics and BMI2 packing; decode's loops are written for GCC's
// vectoriser (selects rather than fminf, whose zero/NaN rules differ).
#pragma once

#if !defined(__AVX2__) || !defined(__BMI2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the Lynx CPU codec needs AVX2, FMA, F16C and BMI2 (x86-64 since Haswell); the torch reference is used instead"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace lynx_codec {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct BF16 {
  using Word = uint16_t;
  static constexpr int kFractionBits = 7;
  static float max() { return bits_to_float(0x7F7F0000u); }
  static float to_float(Word w) { return bits_to_float(static_cast<uint32_t>(w) << 16); }
  static Word from_float(float f) {  // round to nearest even (no NaN reaches here)
    uint32_t u = float_to_bits(f);
    return static_cast<Word>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  static Word round_up(float s) {  // s >= 0 finite: smallest bf16 >= s
    return static_cast<Word>((static_cast<int32_t>(float_to_bits(s)) + 0xFFFF) >> 16);
  }
  static bool non_finite(Word w) { return (w & 0x7F80u) == 0x7F80u; }
  // Eight lanes: float32 values of 8 words, words (int32 lanes) of 8 floats as above.
  static constexpr bool kReciprocalExact = true;  // 8 significant bits, see divide_by_reciprocal
  static __m256 load8(const Word* w) {
    const __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(words), 16));
  }
  static __m256 floats8(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
  static __m256i words8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  }
  static __m256i round_up8(__m256 s) {
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(s), _mm256_set1_epi32(0xFFFF)), 16);
  }
};

// The low 16 bits of 8 int32 lanes holding 16-bit words.
inline __m128i narrow16(__m256i w) {
  return _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

struct FP16 {
  using Word = uint16_t;
  static constexpr int kFractionBits = 10;
  static float max() { return 65504.0f; }
  static float to_float(Word w) {
    _Float16 h;
    std::memcpy(&h, &w, 2);
    return static_cast<float>(h);
  }
  static Word from_float(float f) {
    _Float16 h = static_cast<_Float16>(f);
    Word w;
    std::memcpy(&w, &h, 2);
    return w;
  }
  static Word round_up(float s) {
    Word nearest = from_float(s);
    return static_cast<Word>(nearest + (to_float(nearest) < s ? 1 : 0));
  }
  static bool non_finite(Word w) { return (w & 0x7C00u) == 0x7C00u; }
  static constexpr bool kReciprocalExact = true;  // 11 significant bits, see divide_by_reciprocal
  static __m256 load8(const Word* w) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }
  static __m256 floats8(__m256i w) { return _mm256_cvtph_ps(narrow16(w)); }
  static __m256i words8(__m256 f) { return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT)); }
  static __m256i round_up8(__m256 s) {
    const __m128i nearest = _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT);
    const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(_mm256_cvtph_ps(nearest), s, _CMP_LT_OQ));
    return _mm256_sub_epi32(_mm256_cvtepu16_epi32(nearest), below);  // below is -1 where true
  }
};

struct FP32 {
  using Word = uint32_t;
  static constexpr int kFractionBits = 23;
  static float max() { return bits_to_float(0x7F7FFFFFu); }
  static float to_float(Word w) { return bits_to_float(w); }
  static Word from_float(float f) { return float_to_bits(f); }
  static Word round_up(float s) { return float_to_bits(s); }
  static bool non_finite(Word w) { return (w & 0x7F800000u) == 0x7F800000u; }
  static constexpr bool kReciprocalExact = false;  // 24-bit divisors: too many to verify, divide
  static __m256 load8(const Word* w) { return _mm256_loadu_ps(reinterpret_cast<const float*>(w)); }
  static __m256 floats8(__m256i w) { return _mm256_castsi256_ps(w); }
  static __m256i words8(__m256 f) { return _mm256_castps_si256(f); }
  static __m256i round_up8(__m256 s) { return _mm256_castps_si256(s); }
};

// Store `count` (<= 8) words held in int32 lanes.
template <typename D>
void store_words(__m256i words, int64_t count, typename D::Word* out) {
  typename D::Word lanes[8];
  if constexpr (sizeof(typename D::Word) == 2) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes), narrow16(words));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), words);
  }
  std::memcpy(out, lanes, count * sizeof(typename D::Word));
}

// Codes of k bits, 8 per k bytes, code j of a chunk at bits [k*j, k*j+k) little-endian:
// BMI2 bit extract/deposit of the low k bits of each of 8 code bytes (x86 is little-endian).
// K is a template argument so that the k-byte copies compile to plain moves.
template <int K>
constexpr uint64_t code_mask = 0x0101010101010101ull * ((1u << K) - 1);

template <int K>
void unpack(const uint8_t* in, int64_t count, uint8_t* codes) {
  const int64_t chunks = count / 8;
  for (int64_t c = 0; c < chunks; ++c) {
    uint64_t packed = 0;
    if (K * c + 8 <= K * chunks) {
      std::memcpy(&packed, in + K * c, 8);
    } else {
      std::memcpy(&packed, in + K * c, K);
    }
    const uint64_t word = _pdep_u64(packed, code_mask<K>);
    std::memcpy(codes + 8 * c, &word, 8);
  }
}

// Code widths: anchors 2..4 bits, int8 residuals 6..4 bits.
inline void unpack_bits(int bits, const uint8_t* in, int64_t count, uint8_t* codes) {
  switch (bits) {
    case 2: return unpack<2>(in, count, codes);
    case 3: return unpack<3>(in, count, codes);
    case 4: return unpack<4>(in, count, codes);
    case 5: return unpack<5>(in, count, codes);
    default: return unpack<6>(in, count, codes);
  }
}

struct Part {
  int64_t n, channels, group_size, key_block, bits, scales_offset, codes_offset;
  bool per_channel, exact;
  const int64_t* slots;  // nullptr: row i is token i
  int64_t row(int64_t token) const { return slots ? slots[token] : token; }
  int rbits() const { return 8 - static_cast<int>(bits); }
};

// The (part, unit) work items of several parts, numbered consecutively, so that one parallel
// region covers a whole segment: each region waits for its slowest thread (one sharing its
// core with other load waits a scheduler slice), once per segment rather than once per part.
// A unit is Job::tokens_per_unit(part) consecutive tokens of a part.
class WorkItems {
 public:
  template <typename Job>
  explicit WorkItems(const std::vector<Job>& jobs) {
    for (const Job& job : jobs) {
      const int64_t tokens = Job::tokens_per_unit(job.p);
      starts_.push_back(total_);
      total_ += (job.p.n + tokens - 1) / tokens;
      channels_ = std::max(channels_, job.p.channels);
      tokens_ = std::max(tokens_, tokens);
    }
  }
  int64_t total() const { return total_; }
  int64_t channels() const { return channels_; }
  int64_t tokens() const { return tokens_; }
  // (part index, unit within the part) of an item.
  std::pair<size_t, int64_t> at(int64_t item) const {
    const size_t part = std::upper_bound(starts_.begin(), starts_.end(), item) - starts_.begin() - 1;
    return {part, item - starts_[part]};
  }

 private:
  std::vector<int64_t> starts_;
  int64_t total_ = 0, channels_ = 0, tokens_ = 0;
};

template <typename D>
struct EncodeJob {
  Part p;
  const typename D::Word* rows;
  uint8_t* anchor;
  uint8_t* residual;
  // A key block, or 16 tokens: per-token groups then fill whole 8-lane parameter vectors
  // (one token of 3 x 64 channels has 6 groups of 32).
  static int64_t tokens_per_unit(const Part& p) { return p.per_channel ? p.key_block : 16; }
};

// Divisors within [kReciprocalMin, 1 / kReciprocalMin] keep a, d, 1/d and the remainder of
// divide_by_reciprocal normal wherever a / d >= 2^-8.
constexpr float kReciprocalMin = 0x1p-60f;

// a / d rounded to float32 from the group's y = RN(1 / d): q = RN(a * y), then one Markstein
// correction q + (a - q * d) * y, the remainder exact in a fused multiply-add. Three cheap
// operations instead of a division (5 cycles per 8 lanes, a third of the quantize loop).
// It equals RN(a / d) for every float32 a when d has at most 11 significant bits (bf16 and
// fp16 scales): reciprocal_division_mismatches checks every pair of significands, and powers
// of two scale every step exactly while the values stay normal (d within kReciprocalMin;
// a / d < 2^-8 is inexact only in its last bits and gives the same codes, 0 and centre).
inline __m256 divide_by_reciprocal(__m256 a, __m256 d, __m256 y) {
  const __m256 q = _mm256_mul_ps(a, y);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, d, a), y, q);
}

// Pairs (a, d), a in [1, 2) any float32, d in [1, 2) with `bits` significant bits, where
// divide_by_reciprocal differs from the division (0 for bits <= 11, the claim above).
inline int64_t reciprocal_division_mismatches(int bits) {
  const int fraction = bits - 1;
  int64_t mismatches = 0;
#pragma omp parallel for reduction(+ : mismatches) schedule(dynamic)
  for (int m = 0; m < (1 << fraction); ++m) {
    const __m256 d = _mm256_set1_ps(bits_to_float(0x3F800000u | (static_cast<uint32_t>(m) << (23 - fraction))));
    const __m256 y = _mm256_div_ps(_mm256_set1_ps(1.0f), d);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i count = _mm256_setzero_si256();
    for (uint32_t a_bits = 0x3F800000u; a_bits < 0x40000000u; a_bits += 8) {
      const __m256 a = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_set1_epi32(a_bits), lane));
      const __m256 differ = _mm256_cmp_ps(_mm256_div_ps(a, d), divide_by_reciprocal(a, d, y), _CMP_NEQ_UQ);
      count = _mm256_sub_epi32(count, _mm256_castps_si256(differ));
    }
    int32_t lanes[8];
    std::memcpy(lanes, &count, sizeof(lanes));
    for (int32_t c : lanes) mismatches += c;
  }
  return mismatches;
}

// Copy n bytes to dst with non-temporal stores where dst is 16-byte aligned: the codes are
// written once and read by another agent (the transfer), so caching them would only cost
// a read of each line before it is overwritten. Callers order the stores (sfence) before
// anything reads them.
inline void stream_copy(uint8_t* dst, const uint8_t* src, int64_t n) {
  const int64_t head = std::min<int64_t>(n, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  int64_t at = head;
  for (; at + 16 <= n; at += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + at), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + at)));
  std::memcpy(dst + at, src + at, n - at);
}

// Per-thread buffers of the encoder, sized for the widest part: the rows of a unit, group
// extremes, per group (channel, or per-token group) half_lo = lo * 0.5, the divisor d and
// y = RN(1 / d) (padded to whole 8-lane vectors), and the unit's packed codes.
template <typename D>
struct EncodeScratch {
  EncodeScratch(int64_t channels, int64_t tokens)
      : rows(tokens),
        lo(padded(std::max(channels, tokens * channels / 8))),
        hi(lo.size()),
        half_lo(lo.size()),
        divisor(lo.size()),
        reciprocal(lo.size()),
        anchor_codes(tokens * channels + 8),
        fine_codes(tokens * channels + 8) {}
  static size_t padded(int64_t n) { return static_cast<size_t>((n + 7) / 8 * 8); }

  std::vector<const typename D::Word*> rows;
  std::vector<float> lo, hi, half_lo, divisor, reciprocal;
  std::vector<uint8_t> anchor_codes, fine_codes;  // a unit's packed codes (+ 8 bytes slack)
};

// Extremes of 8 lanes. Any reduction order gives the reference's value: a NaN fails the
// unit's finite check, and the sign of a zero extreme is dropped (+ 0.0) before use.
inline float horizontal_min(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// |x| as integers: a lane is finite iff its magnitude is below 0x7F800000 (one max per
// vector accumulates a unit's verdict).
inline __m256i magnitude(__m256 x) {
  return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
}

// Group parameters of n groups from their extremes (format.py's order of float32 operations,
// 8 groups per step; lanes past n are zero, a constant group): the minimum and scale words
// into the anchor, the quantize factors into the scratch. Returns whether every divisor
// lies where divide_by_reciprocal is exact.
template <typename D>
bool group_params(EncodeScratch<D>& s, int64_t n, float levels, typename D::Word* mins, typename D::Word* scales) {
  const __m256 half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  __m256 in_range = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int64_t g = 0; g < n; g += 8) {
    const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(s.lo.data() + g), zero);  // -0.0 -> +0.0
    const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(s.hi.data() + g), zero);
    const __m256 step = _mm256_mul_ps(
        _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(hi, half), _mm256_mul_ps(lo, half)), _mm256_set1_ps(levels)),
        _mm256_set1_ps(2.0f));
    const __m256i scale_words = D::round_up8(step);
    const __m256 half_step = _mm256_mul_ps(D::floats8(scale_words), half);
    const __m256 divisor = _mm256_blendv_ps(one, half_step, _mm256_cmp_ps(half_step, zero, _CMP_GT_OQ));
    store_words<D>(D::words8(lo), std::min<int64_t>(8, n - g), mins + g);
    store_words<D>(scale_words, std::min<int64_t>(8, n - g), scales + g);
    _mm256_storeu_ps(s.half_lo.data() + g, _mm256_mul_ps(lo, half));
    _mm256_storeu_ps(s.divisor.data() + g, divisor);
    _mm256_storeu_ps(s.reciprocal.data() + g, _mm256_div_ps(one, divisor));
    in_range = _mm256_and_ps(in_range, _mm256_cmp_ps(divisor, _mm256_set1_ps(kReciprocalMin), _CMP_GE_OQ));
    in_range = _mm256_and_ps(in_range, _mm256_cmp_ps(divisor, _mm256_set1_ps(1.0f / kReciprocalMin), _CMP_LE_OQ));
  }
  return _mm256_movemask_ps(in_range) == 0xFF;
}

// Codes of K-bit anchors: per value one byte (u << r) + v + centre (u alone for an exact
// residual, Fine false), the anchor code in its high K bits and the residual code in its low
// r bits, split by BMI2 bit extracts. Reciprocal: t by divide_by_reciprocal, else divided.
template <typename D, int K, bool Fine, bool Reciprocal>
struct Quantize {
  static constexpr int R = 8 - K;
  // Bits of each of 8 code bytes that hold the anchor / residual code.
  static constexpr uint64_t kAnchorBits = 0x0101010101010101ull * (((1u << K) - 1) << (Fine ? R : 0));
  static constexpr uint64_t kFineBits = 0x0101010101010101ull * ((1u << R) - 1);

  // Code bytes (int32 lanes) of 8 values; factors per lane (PerChannel) or one broadcast.
  template <bool PerChannel>
  static __m256i codes8(const typename D::Word* x, const float* half_lo, const float* divisor, const float* rcp) {
    const auto factor = [](const float* f) { return PerChannel ? _mm256_loadu_ps(f) : _mm256_broadcast_ss(f); };
    const __m256 a = _mm256_sub_ps(_mm256_mul_ps(D::load8(x), _mm256_set1_ps(0.5f)), factor(half_lo));
    const __m256 t = Reciprocal ? divide_by_reciprocal(a, factor(divisor), factor(rcp))
                                : _mm256_div_ps(a, factor(divisor));
    // Conversions round half to even (MXCSR's default mode, which every float32 operation
    // here relies on). u = clamp(round(t), 0, L).
    const __m256i u = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(t), _mm256_setzero_si256()),
                                       _mm256_set1_epi32((1 << K) - 1));
    if constexpr (!Fine) return u;
    // (u << r) + clamp(round((t - u) * 2^r), -c, c - 1) + c with c = 2^(r-1) equals
    // clamp(round(t * 2^r) + c, u << r, (u << r) + 2^r - 1): t - u and the scaling are exact,
    // and u * 2^r is an even integer, so shifting by it does not change the rounding of a tie.
    // (Adding c before rounding would not be exact for small t.)
    const __m256i high = _mm256_slli_epi32(u, R);
    const __m256i shifted = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(t, _mm256_set1_ps(1 << R))),
                                             _mm256_set1_epi32(1 << (R - 1)));
    return _mm256_min_epi32(_mm256_max_epi32(shifted, high), _mm256_or_si256(high, _mm256_set1_epi32((1 << R) - 1)));
  }

  // Pack 8 code bytes to K anchor bytes (and R residual bytes) at *anchor (*residual),
  // advancing both: whole 8-byte stores into the unit's buffers (8 bytes of slack), the
  // excess overwritten by the next codes.
  static void emit(uint64_t bytes, uint8_t*& anchor, uint8_t*& residual) {
    const uint64_t codes = _pext_u64(bytes, kAnchorBits);
    std::memcpy(anchor, &codes, 8);
    anchor += K;
    if constexpr (Fine) {
      const uint64_t fine_codes = _pext_u64(bytes, kFineBits);
      std::memcpy(residual, &fine_codes, 8);
      residual += R;
    }
  }

  // 16 values at column c: code bytes (w0 then w1) in the low 128 bits.
  template <bool PerChannel>
  static void step16(const typename D::Word* x, int64_t c, int64_t G, const float* hl, const float* dv,
                     const float* rc, uint8_t*& anchor, uint8_t*& residual) {
    const int64_t f0 = PerChannel ? c : c / G, f1 = PerChannel ? c + 8 : (c + 8) / G;
    const __m256i w0 = codes8<PerChannel>(x + c, hl + f0, dv + f0, rc + f0);
    const __m256i w1 = codes8<PerChannel>(x + c + 8, hl + f1, dv + f1, rc + f1);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(w0, w1), _mm256_setzero_si256());
    const __m128i ordered =
        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
    emit(static_cast<uint64_t>(_mm_cvtsi128_si64(ordered)), anchor, residual);
    emit(static_cast<uint64_t>(_mm_extract_epi64(ordered, 1)), anchor, residual);
  }

  // 32 values at column c with 4-bit anchors and residuals (the default): nibbles paired in
  // SIMD registers, half the instructions of the extracts.
  template <bool PerChannel>
  static void step32_nibbles(const typename D::Word* x, int64_t c, int64_t G, const float* hl, const float* dv,
                             const float* rc, uint8_t*& anchor, uint8_t*& residual) {
    __m256i w[4];
    for (int k = 0; k < 4; ++k) {
      const int64_t f = PerChannel ? c + 8 * k : (c + 8 * k) / G;
      w[k] = codes8<PerChannel>(x + c + 8 * k, hl + f, dv + f, rc + f);
    }
    // int32 lanes -> the 32 code bytes in order.
    const __m256i bytes =
        _mm256_permutevar8x32_epi32(_mm256_packus_epi16(_mm256_packus_epi32(w[0], w[1]), _mm256_packus_epi32(w[2], w[3])),
                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i pair = _mm256_set1_epi16(0x1001);  // even byte + 16 * odd byte
    const __m256i anchor_pairs = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble), pair);
    const __m256i fine_pairs = _mm256_maddubs_epi16(_mm256_and_si256(bytes, nibble), pair);
    // 64-bit quarters: anchor 0-7, residual 0-7, anchor 8-15, residual 8-15 -> anchor | residual.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(anchor_pairs, fine_pairs), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(anchor), _mm256_castsi256_si128(packed));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(residual), _mm256_extracti128_si256(packed, 1));
    anchor += 16;
    residual += 16;
  }

  // One row of C values; factors per channel, or per group of G channels.
  template <bool PerChannel>
  static void row(const typename D::Word* x, int64_t C, int64_t G, const float* hl, const float* dv,
                  const float* rc, uint8_t* anchor, uint8_t* residual) {
    int64_t c = 0;
    if constexpr (K == 4 && Fine) {
      for (; c + 32 <= C; c += 32) step32_nibbles<PerChannel>(x, c, G, hl, dv, rc, anchor, residual);
    }
    for (; c + 16 <= C; c += 16) step16<PerChannel>(x, c, G, hl, dv, rc, anchor, residual);
    if (c < C) {
      const int64_t f = PerChannel ? c : c / G;
      const __m128i words = narrow16(codes8<PerChannel>(x + c, hl + f, dv + f, rc + f));
      emit(static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_packus_epi16(words, words))), anchor, residual);
    }
  }

  // The codes of a unit's rows (token `first` onwards), assembled in the scratch and
  // streamed to the part's code arrays (the unit's codes are contiguous there).
  static void rows(const Part& p, const typename D::Word* const* x, int64_t first, int64_t count,
                   EncodeScratch<D>& s, uint8_t* codes, uint8_t* residual) {
    const int64_t C = p.channels, G = p.group_size;
    const float *hl = s.half_lo.data(), *dv = s.divisor.data(), *rc = s.reciprocal.data();
    for (int64_t i = 0; i < count; ++i) {
      uint8_t* anchor_row = s.anchor_codes.data() + i * C * K / 8;
      uint8_t* fine_row = s.fine_codes.data() + i * C * R / 8;
      if (p.per_channel) {
        row<true>(x[i], C, G, hl, dv, rc, anchor_row, fine_row);
      } else {
        const int64_t f = i * (C / G);
        row<false>(x[i], C, G, hl + f, dv + f, rc + f, anchor_row, fine_row);
      }
    }
    stream_copy(codes + first * C * K / 8, s.anchor_codes.data(), count * C * K / 8);
    if (Fine) stream_copy(residual + first * C * R / 8, s.fine_codes.data(), count * C * R / 8);
  }
};

// One unit of one part with K-bit anchors: group extremes (and the finite check), group
// parameters, then the codes of each row while it is still in L1. False (nothing useful
// written) when its input is not finite.
template <typename D, int K>
bool encode_unit(const EncodeJob<D>& job, int64_t unit, EncodeScratch<D>& s) {
  using Word = typename D::Word;
  const Part& p = job.p;
  const int64_t C = p.channels;
  const int64_t first = unit * EncodeJob<D>::tokens_per_unit(p);
  const int64_t count = std::min(EncodeJob<D>::tokens_per_unit(p), p.n - first);
  const Word** rows = s.rows.data();
  // Request every line of the unit's rows before reading any: the rows are scattered over
  // the pool, and reading them in order waits on one row's misses at a time (one thread,
  // 2048-token segment: 2.0 -> 1.2-1.5 ns per value).
  const int64_t row_bytes = C * static_cast<int64_t>(sizeof(Word));
  for (int64_t i = 0; i < count; ++i) {
    rows[i] = job.rows + p.row(first + i) * C;
    for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(rows[i]) + at, _MM_HINT_T0);
  }
  __m256i largest = _mm256_setzero_si256();  // of the magnitudes
  int64_t groups, params_at;
  if (p.per_channel) {
    for (int64_t c = 0; c < C; c += 8) {
      __m256 lo = D::load8(rows[0] + c), hi = lo;
      largest = _mm256_max_epu32(largest, magnitude(lo));
      for (int64_t i = 1; i < count; ++i) {
        const __m256 x = D::load8(rows[i] + c);
        largest = _mm256_max_epu32(largest, magnitude(x));
        lo = _mm256_min_ps(x, lo);  // x < lo ? x : lo
        hi = _mm256_max_ps(x, hi);
      }
      _mm256_storeu_ps(s.lo.data() + c, lo);
      _mm256_storeu_ps(s.hi.data() + c, hi);
    }
    groups = C;
    params_at = unit * C;
  } else {
    const int64_t G = p.group_size;
    const int64_t per_row = C / G;
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t g = 0; g < per_row; ++g) {
        const Word* x = rows[i] + g * G;
        __m256 lo = D::load8(x), hi = lo;
        largest = _mm256_max_epu32(largest, magnitude(lo));
        for (int64_t j = 8; j < G; j += 8) {
          const __m256 v = D::load8(x + j);
          largest = _mm256_max_epu32(largest, magnitude(v));
          lo = _mm256_min_ps(v, lo);
          hi = _mm256_max_ps(v, hi);
        }
        s.lo[i * per_row + g] = horizontal_min(lo);
        s.hi[i * per_row + g] = horizontal_max(hi);
      }
    }
    groups = count * per_row;
    for (size_t g = static_cast<size_t>(groups); g < EncodeScratch<D>::padded(groups); ++g) s.lo[g] = s.hi[g] = 0.0f;
    params_at = first * per_row;
  }
  const __m256i non_finite = _mm256_cmpgt_epi32(largest, _mm256_set1_epi32(0x7F7FFFFF));
  if (!_mm256_testz_si256(non_finite, non_finite)) return false;

  Word* mins = reinterpret_cast<Word*>(job.anchor) + params_at;
  Word* scales = reinterpret_cast<Word*>(job.anchor + p.scales_offset) + params_at;
  const float levels = static_cast<float>((1 << K) - 1);
  const bool in_range = group_params<D>(s, groups, levels, mins, scales);
  uint8_t* codes = job.anchor + p.codes_offset;
  if (p.exact) {
    if (D::kReciprocalExact && in_range) {
      Quantize<D, K, false, D::kReciprocalExact>::rows(p, rows, first, count, s, codes, job.residual);
    } else {
      Quantize<D, K, false, false>::rows(p, rows, first, count, s, codes, job.residual);
    }
  } else if (D::kReciprocalExact && in_range) {
    Quantize<D, K, true, D::kReciprocalExact>::rows(p, rows, first, count, s, codes, job.residual);
  } else {
    Quantize<D, K, true, false>::rows(p, rows, first, count, s, codes, job.residual);
  }
  return true;
}

// Encode several parts in one parallel region; per part, whether all its input was finite.
template <typename D, int K>
std::vector<bool> encode_parts_k(const std::vector<EncodeJob<D>>& jobs, int threads) {
  const WorkItems items(jobs);
  std::vector<uint8_t> finite(jobs.size(), 1);
#pragma omp parallel num_threads(threads)
  {
    EncodeScratch<D> scratch(items.channels(), items.tokens());
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items.total(); ++item) {
      const auto [part, unit] = items.at(item);
      if (!encode_unit<D, K>(jobs[part], unit, scratch)) {
#pragma omp atomic write
        finite[part] = 0;
      }
    }
    _mm_sfence();  // the streamed codes are complete before the region ends
  }
  return std::vector<bool>(finite.begin(), finite.end());
}

template <typename D>
std::vector<bool> encode_parts(const std::vector<EncodeJob<D>>& jobs, int threads) {
  switch (jobs.front().p.bits) {
    case 2: return encode_parts_k<D, 2>(jobs, threads);
    case 3: return encode_parts_k<D, 3>(jobs, threads);
    default: return encode_parts_k<D, 4>(jobs, threads);
  }
}

template <typename D>
struct DecodeJob {
  Part p;
  const uint8_t* anchor;
  const uint8_t* residual;  // nullptr: Anchor only; never a lossless one (cpu_codec_lossless.h)
  typename D::Word* rows;
  static int64_t tokens_per_unit(const Part& p) { return p.per_channel ? p.key_block : 1; }
};

// Per-thread buffers of the decoder, sized for the widest part.
struct Scratch {
  explicit Scratch(int64_t channels) : x(channels), hl(channels), hi(channels), u(channels), v(channels) {}
  std::vector<float> x, hl, hi;
  std::vector<uint8_t> u, v;
};

template <typename D>
void decode_unit(const DecodeJob<D>& job, int64_t unit, Scratch& s) {
  using Word = typename D::Word;
  const Part& p = job.p;
  const uint8_t* residual = job.residual;
  Word* rows = job.rows;
  const int64_t C = p.channels;
  const int bits = static_cast<int>(p.bits);
  const int rbits = p.rbits();
  const Word* mins = reinterpret_cast<const Word*>(job.anchor);
  const Word* scales = reinterpret_cast<const Word*>(job.anchor + p.scales_offset);
  const uint8_t* codes = job.anchor + p.codes_offset;
  const int64_t anchor_row = C * bits / 8;
  const int64_t fine_row = C * rbits / 8;
  const int64_t tokens_per_unit = DecodeJob<D>::tokens_per_unit(p);
  const float finite_max = D::max();
  const float fine_step = 1.0f / static_cast<float>(1 << rbits);
  const int32_t centre = 1 << (rbits - 1);
  const int64_t G = p.per_channel ? 1 : p.group_size;
  std::vector<float>&w = s.x, &hs = s.hi, &hl = s.hl;
  std::vector<uint8_t>&u = s.u, &v = s.v;
  const int64_t first = unit * tokens_per_unit;
  const int64_t count = std::min(tokens_per_unit, p.n - first);
  // Per-channel: one factor per channel for the whole block; per token: one per group.
  const int64_t params_at = p.per_channel ? unit * C : unit * (C / G);
  const int64_t nparams = p.per_channel ? C : C / G;
  for (int64_t g = 0; g < nparams; ++g) {
    hs[g] = D::to_float(scales[params_at + g]) * 0.5f;
    hl[g] = D::to_float(mins[params_at + g]) * 0.5f;
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t token = first + i;
    unpack_bits(bits, codes + token * anchor_row, C, u.data());
    if (residual) {
      unpack_bits(rbits, residual + token * fine_row, C, v.data());
      for (int64_t c = 0; c < C; ++c)
        w[c] = static_cast<float>((static_cast<int32_t>(u[c]) << rbits) + v[c] - centre) * fine_step;
    } else {
      for (int64_t c = 0; c < C; ++c) w[c] = static_cast<float>(u[c]);
    }
    Word* dst = rows + p.row(token) * C;
    if (p.per_channel) {
      for (int64_t c = 0; c < C; ++c) {
        float y = (w[c] * hs[c] + hl[c]) * 2.0f;
        y = y < -finite_max ? -finite_max : y;
        y = y > finite_max ? finite_max : y;
        dst[c] = D::from_float(y);
      }
    } else {
      for (int64_t g = 0; g < C / G; ++g) {
        const float s = hs[g], m = hl[g];
        for (int64_t j = 0; j < G; ++j) {
          float y = (w[g * G + j] * s + m) * 2.0f;
          y = y < -finite_max ? -finite_max : y;
          y = y > finite_max ? finite_max : y;
          dst[g * G + j] = D::from_float(y);
        }
      }
    }
  }
}

template <typename D>
void decode_parts(const std::vector<DecodeJob<D>>& jobs, int threads) {
  const WorkItems items(jobs);
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(items.channels());
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items.total(); ++item) {
      const auto [part, unit] = items.at(item);
      decode_unit(jobs[part], unit, scratch);
    }
  }
}

// 0: every group minimum and scale finite and every scale >= 0; 1: one is not finite;
// 2: a scale is negative (the order and codes of reference.anchor_params_fault).
template <typename D>
int anchor_params_fault(const uint8_t* anchor, int64_t groups, int64_t scales_offset) {
  const typename D::Word* mins = reinterpret_cast<const typename D::Word*>(anchor);
  const typename D::Word* scales = reinterpret_cast<const typename D::Word*>(anchor + scales_offset);
  bool non_finite = false, negative = false;
  for (int64_t g = 0; g < groups; ++g) {
    non_finite |= D::non_finite(mins[g]) | D::non_finite(scales[g]);
    negative |= D::to_float(scales[g]) < 0.0f;
  }
  return non_finite ? 1 : negative ? 2 : 0;
}

}  // namespace lynx_codec
