// Kernels of the fused CPU codec, free of torch (bindings in cpu_codec.cpp). The math and
// byte layout are those of format.py, float32 operations in exactly its order; built with
// -ffp-contract=off and without -ffast-math so every operation rounds as in the torch
// reference. The quantize step is AVX2 intrinsics, packing BMI2; the other loops are
// written for GCC's vectoriser (selects rather than fminf, whose zero/NaN rules differ).
#pragma once

#if !defined(__AVX2__) || !defined(__BMI2__)
#error "the Lynx CPU codec needs AVX2 and BMI2 (x86-64 since Haswell); the torch reference is used instead"
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
};

struct FP16 {
  using Word = uint16_t;
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
};

struct FP32 {
  using Word = uint32_t;
  static float max() { return bits_to_float(0x7F7FFFFFu); }
  static float to_float(Word w) { return bits_to_float(w); }
  static Word from_float(float f) { return float_to_bits(f); }
  static Word round_up(float s) { return float_to_bits(s); }
  static bool non_finite(Word w) { return (w & 0x7F800000u) == 0x7F800000u; }
};

// Codes of k bits, 8 per k bytes, code j of a chunk at bits [k*j, k*j+k) little-endian:
// BMI2 bit extract/deposit of the low k bits of each of 8 code bytes (x86 is little-endian).
// K is a template argument so that the k-byte copies compile to plain moves.
template <int K>
constexpr uint64_t code_mask = 0x0101010101010101ull * ((1u << K) - 1);

// Whole 8-byte loads and stores (a k-byte copy through memory stalls store forwarding);
// the chunks within 8 bytes of a row's end copy exactly k bytes, so no byte outside the row
// is touched (another thread owns the next row).
template <int K>
void pack(const uint8_t* codes, int64_t count, uint8_t* out) {
  const int64_t chunks = count / 8;
  for (int64_t c = 0; c < chunks; ++c) {
    uint64_t word;
    std::memcpy(&word, codes + 8 * c, 8);
    const uint64_t packed = _pext_u64(word, code_mask<K>);
    if (K * c + 8 <= K * chunks) {
      std::memcpy(out + K * c, &packed, 8);
    } else {
      std::memcpy(out + K * c, &packed, K);
    }
  }
}

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
inline void pack_bits(int bits, const uint8_t* codes, int64_t count, uint8_t* out) {
  switch (bits) {
    case 2: return pack<2>(codes, count, out);
    case 3: return pack<3>(codes, count, out);
    case 4: return pack<4>(codes, count, out);
    case 5: return pack<5>(codes, count, out);
    default: return pack<6>(codes, count, out);
  }
}

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

// Group parameters as the encoder derives them: the stored words and the float32 factors.
template <typename D>
struct GroupParams {
  typename D::Word min_word, scale_word;
  float half_lo, divisor;
};

template <typename D>
inline GroupParams<D> group_params(float lo, float hi, float levels) {
  lo = lo + 0.0f;  // -0.0 -> +0.0
  hi = hi + 0.0f;
  GroupParams<D> p;
  p.min_word = D::from_float(lo);
  p.scale_word = D::round_up(((hi * 0.5f - lo * 0.5f) / levels) * 2.0f);
  float half_step = D::to_float(p.scale_word) * 0.5f;
  p.divisor = half_step > 0.0f ? half_step : 1.0f;
  p.half_lo = lo * 0.5f;
  return p;
}

// Eight uint8 codes from eight float32 integers in 0..255.
inline void store_codes(__m256 codes, uint8_t* out) {
  const __m256i words = _mm256_cvttps_epi32(codes);
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(halves, halves));
}

// Anchor and residual codes of n (a multiple of 8) values, each with its group's factors.
// AVX2: _mm256_round_ps rounds half to even exactly; GCC does not vectorise roundevenf.
inline void quantize(const float* x, const float* half_lo, const float* divisor, int64_t n, float levels,
                     int rbits, bool fine, uint8_t* u_out, uint8_t* v_out) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 half = _mm256_set1_ps(0.5f), zero = _mm256_setzero_ps(), top = _mm256_set1_ps(levels);
  const __m256 fine_scale = _mm256_set1_ps(static_cast<float>(1 << rbits));
  const __m256 centre = _mm256_set1_ps(static_cast<float>(1 << (rbits - 1)));
  const __m256 fine_lo = _mm256_sub_ps(zero, centre);
  const __m256 fine_hi = _mm256_sub_ps(centre, _mm256_set1_ps(1.0f));
  for (int64_t c = 0; c < n; c += 8) {
    const __m256 xs = _mm256_mul_ps(_mm256_loadu_ps(x + c), half);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(xs, _mm256_loadu_ps(half_lo + c)), _mm256_loadu_ps(divisor + c));
    const __m256 u = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(t, nearest), zero), top);
    store_codes(u, u_out + c);
    if (fine) {
      const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, u), fine_scale), nearest);
      store_codes(_mm256_add_ps(_mm256_min_ps(_mm256_max_ps(v, fine_lo), fine_hi), centre), v_out + c);
    }
  }
}

inline int64_t tokens_per_unit(const Part& p) { return p.per_channel ? p.key_block : 1; }

// Work units of a part: one key block (per-channel keys) or one token.
inline int64_t units_of(const Part& p) { return (p.n + tokens_per_unit(p) - 1) / tokens_per_unit(p); }

// The (part, unit) work items of several parts, numbered consecutively, so that one parallel
// region covers a whole segment: each region waits for its slowest thread (one sharing its
// core with other load waits a scheduler slice), once per segment rather than once per part.
class WorkItems {
 public:
  template <typename Job>
  explicit WorkItems(const std::vector<Job>& jobs) {
    for (const Job& job : jobs) {
      starts_.push_back(total_);
      total_ += units_of(job.p);
      channels_ = std::max(channels_, job.p.channels);
      tokens_ = std::max(tokens_, tokens_per_unit(job.p));
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
};

// Per-thread buffers, sized for the widest part.
struct Scratch {
  Scratch(int64_t channels, int64_t tokens)
      : x(tokens * channels), hl(channels), dv(channels), lo(channels), hi(channels), u(channels), v(channels) {}
  std::vector<float> x, hl, dv, lo, hi;
  std::vector<uint8_t> u, v;
};

// One unit of one part; false (nothing useful written) when its input is not finite.
template <typename D>
bool encode_unit(const EncodeJob<D>& job, int64_t unit, Scratch& s) {
  using Word = typename D::Word;
  const Part& p = job.p;
  const Word* rows = job.rows;
  uint8_t* residual = job.residual;
  const int64_t C = p.channels;
  const int bits = static_cast<int>(p.bits);
  const int rbits = p.rbits();
  const float levels = static_cast<float>((1 << bits) - 1);
  const bool fine = !p.exact;
  Word* mins = reinterpret_cast<Word*>(job.anchor);
  Word* scales = reinterpret_cast<Word*>(job.anchor + p.scales_offset);
  uint8_t* codes = job.anchor + p.codes_offset;
  const int64_t anchor_row = C * bits / 8;
  const int64_t fine_row = C * rbits / 8;
  const int64_t tokens_per_unit = lynx_codec::tokens_per_unit(p);
  std::vector<float>&x = s.x, &hl = s.hl, &dv = s.dv, &lo = s.lo, &hi = s.hi;
  std::vector<uint8_t>&u = s.u, &v = s.v;
  const int64_t first = unit * tokens_per_unit;
  const int64_t count = std::min(tokens_per_unit, p.n - first);
  uint32_t flags = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Word* src = rows + p.row(first + i) * C;
    float* dst = x.data() + i * C;
    for (int64_t c = 0; c < C; ++c) {
      dst[c] = D::to_float(src[c]);
      flags |= D::non_finite(src[c]);
    }
    if (p.exact) std::memcpy(reinterpret_cast<Word*>(residual) + (first + i) * C, src, C * sizeof(Word));
  }
  if (flags) return false;
  if (p.per_channel) {
    std::memcpy(lo.data(), x.data(), C * sizeof(float));
    std::memcpy(hi.data(), x.data(), C * sizeof(float));
    for (int64_t i = 1; i < count; ++i) {
      const float* row = x.data() + i * C;
      for (int64_t c = 0; c < C; ++c) {
        lo[c] = row[c] < lo[c] ? row[c] : lo[c];
        hi[c] = row[c] > hi[c] ? row[c] : hi[c];
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      GroupParams<D> g = group_params<D>(lo[c], hi[c], levels);
      mins[unit * C + c] = g.min_word;
      scales[unit * C + c] = g.scale_word;
      hl[c] = g.half_lo;
      dv[c] = g.divisor;
    }
    for (int64_t i = 0; i < count; ++i) {
      quantize(x.data() + i * C, hl.data(), dv.data(), C, levels, rbits, fine, u.data(), v.data());
      pack_bits(bits, u.data(), C, codes + (first + i) * anchor_row);
      if (fine) pack_bits(rbits, v.data(), C, residual + (first + i) * fine_row);
    }
  } else {
    const int64_t G = p.group_size;
    const int64_t groups = C / G;
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x.data() + g * G;
      typedef float Lanes __attribute__((vector_size(32)));
      Lanes l8, h8;
      std::memcpy(&l8, xg, sizeof(Lanes));
      h8 = l8;
      for (int64_t j = 8; j < G; j += 8) {
        Lanes val;
        std::memcpy(&val, xg + j, sizeof(Lanes));
        l8 = val < l8 ? val : l8;
        h8 = val > h8 ? val : h8;
      }
      float l = l8[0], h = h8[0];
      for (int k = 1; k < 8; ++k) {
        l = l8[k] < l ? l8[k] : l;
        h = h8[k] > h ? h8[k] : h;
      }
      GroupParams<D> gp = group_params<D>(l, h, levels);
      mins[unit * groups + g] = gp.min_word;
      scales[unit * groups + g] = gp.scale_word;
      std::fill_n(hl.data() + g * G, G, gp.half_lo);
      std::fill_n(dv.data() + g * G, G, gp.divisor);
    }
    quantize(x.data(), hl.data(), dv.data(), C, levels, rbits, fine, u.data(), v.data());
    pack_bits(bits, u.data(), C, codes + unit * anchor_row);
    if (fine) pack_bits(rbits, v.data(), C, residual + unit * fine_row);
  }
  return true;
}

// Encode several parts in one parallel region; per part, whether all its input was finite.
template <typename D>
std::vector<bool> encode_parts(const std::vector<EncodeJob<D>>& jobs, int threads) {
  const WorkItems items(jobs);
  std::vector<uint8_t> finite(jobs.size(), 1);
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(items.channels(), items.tokens());
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items.total(); ++item) {
      const auto [part, unit] = items.at(item);
      if (!encode_unit(jobs[part], unit, scratch)) {
#pragma omp atomic write
        finite[part] = 0;
      }
    }
  }
  return std::vector<bool>(finite.begin(), finite.end());
}

template <typename D>
struct DecodeJob {
  Part p;
  const uint8_t* anchor;
  const uint8_t* residual;  // nullptr: Anchor only
  typename D::Word* rows;
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
  const int64_t tokens_per_unit = lynx_codec::tokens_per_unit(p);
  const float finite_max = D::max();
  const float fine_step = 1.0f / static_cast<float>(1 << rbits);
  const int32_t centre = 1 << (rbits - 1);
  const int64_t G = p.per_channel ? 1 : p.group_size;
  std::vector<float>&w = s.x, &hs = s.hi, &hl = s.hl;
  std::vector<uint8_t>&u = s.u, &v = s.v;
  const int64_t first = unit * tokens_per_unit;
  const int64_t count = std::min(tokens_per_unit, p.n - first);
  if (residual && p.exact) {
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(rows + p.row(first + i) * C, reinterpret_cast<const Word*>(residual) + (first + i) * C,
                  C * sizeof(Word));
    return;
  }
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
    Scratch scratch(items.channels(), 1);
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
