// A fuzz target for the C++ lossless Residual decoder (python/lynx/codec/csrc), built with
// AddressSanitizer and UndefinedBehaviorSanitizer by scripts/fuzz_codec.sh: it encodes
// random KV parts, checks that each decodes back bit for bit, then hands the decoder
// mutated bodies (bits flipped, bytes set, cut, extended, spliced) and mutated Anchors,
// each in a heap buffer of exactly its length, so that any read or write out of bounds,
// any overflow or shift out of range stops the run with the sanitizer's report. A mutated
// body must decode or report a fault; nothing else is checked of it (a mutation may keep
// a body valid). Deterministic for a seed.
//
//   codec_fuzz [seconds] [seed]      prints "codec_fuzz: N bodies, F faults, seed S"
//   codec_fuzz --canary              reads past a buffer: a build whose sanitizer is live fails
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>

#include "../python/lynx/codec/csrc/cpu_codec_lossless.h"

namespace {

using namespace lynx_codec;
using Word = BF16::Word;

constexpr int64_t kAlign = 16;  // lynx.codec.format.ALIGN
int64_t align(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// One part's geometry and buffers, laid out as lynx.codec.format.part_layout lays them.
struct Sample {
  Part p{};
  std::vector<Word> rows;
  std::vector<uint8_t> anchor, residual;
  int64_t used = 0;  // the lossless body's length
};

Sample encode_random(std::mt19937_64& rng) {
  Sample s;
  Part& p = s.p;
  const int64_t channels[] = {32, 64, 128};
  p.channels = channels[rng() % 3];
  p.n = 1 + static_cast<int64_t>(rng() % 48);
  p.per_channel = rng() % 2;
  p.group_size = 32;
  p.key_block = 16;
  p.bits = 2 + static_cast<int64_t>(rng() % 3);
  p.exact = true;
  p.slots = nullptr;
  const int64_t groups = p.per_channel ? (p.n + p.key_block - 1) / p.key_block * p.channels
                                       : p.n * (p.channels / p.group_size);
  const int64_t param = groups * static_cast<int64_t>(sizeof(Word));
  p.scales_offset = align(param);
  p.codes_offset = p.scales_offset + align(param);
  s.anchor.assign(p.codes_offset + align(p.n * p.channels * p.bits / 8), 0);
  s.residual.assign(1 + p.n * p.channels * sizeof(Word), 0);
  // Finite BF16 words of a few shapes: normal-ish values, a constant run, tiny and huge ones.
  const int shape = static_cast<int>(rng() % 4);
  s.rows.resize(p.n * p.channels);
  std::normal_distribution<float> normal(0.0f, shape == 3 ? 1e30f : 1.0f);
  for (Word& w : s.rows) {
    float f = shape == 1 ? 0.5f : normal(rng) * (shape == 2 ? 1e-30f : 1.0f);
    w = BF16::from_float(f);
    if (((w >> 7) & 0xFF) == 0xFF) w = 0;  // never a NaN or infinity: the encoder refuses them
  }
  std::vector<EncodeJob<BF16>> jobs{{p, s.rows.data(), s.anchor.data(), s.residual.data()}};
  const std::vector<bool> finite = encode_parts(jobs, 1);
  if (!finite[0]) std::abort();
  s.used = encode_lossless_parts(jobs, finite, 1)[0];
  if (s.used < 1 || s.used > static_cast<int64_t>(s.residual.size())) std::abort();
  return s;
}

// Decode ``body`` (exactly ``body.size()`` bytes on the heap) against ``anchor``: the fault.
int64_t decode(const Part& p, const std::vector<uint8_t>& anchor, const std::vector<uint8_t>& body,
               std::vector<Word>& out) {
  std::unique_ptr<uint8_t[]> a(new uint8_t[anchor.size()]), b(new uint8_t[body.size() + 1]);
  std::memcpy(a.get(), anchor.data(), anchor.size());
  std::memcpy(b.get(), body.data(), body.size());
  out.assign(p.n * p.channels, 0);
  std::vector<DecodeJob<BF16>> jobs{{p, a.get(), b.get(), out.data()}};
  return decode_lossless_parts(jobs, {static_cast<int64_t>(body.size())}, 1)[0];
}

// ``resize``: the body's length may change; an Anchor's may not (the binding checks it
// against the part's geometry before the kernels run: test_codec_cpp).
void mutate(std::vector<uint8_t>& bytes, std::mt19937_64& rng, bool resize) {
  int kind = static_cast<int>(rng() % 6);
  if (!resize && (kind == 2 || kind == 3)) kind = 0;
  const size_t size = bytes.size();
  if (kind == 0 && size) {  // flip a few bits
    for (int i = 0, k = 1 + static_cast<int>(rng() % 4); i < k; ++i) bytes[rng() % size] ^= 1u << (rng() % 8);
  } else if (kind == 1 && size) {  // set a byte to an edge value
    const uint8_t edges[] = {0, 1, 0x7F, 0x80, 0xFF, 15, 16};
    bytes[rng() % size] = edges[rng() % 7];
  } else if (kind == 2) {  // cut
    bytes.resize(size ? rng() % size : 0);
  } else if (kind == 3) {  // extend with random bytes
    for (int i = 0, k = 1 + static_cast<int>(rng() % 64); i < k; ++i) bytes.push_back(static_cast<uint8_t>(rng()));
  } else if (kind == 4 && size > 2) {  // splice a run onto another place
    const size_t from = rng() % size, to = rng() % size, len = 1 + rng() % std::min<size_t>(32, size - std::max(from, to));
    std::memmove(bytes.data() + to, bytes.data() + from, len);
  } else if (size > 1) {  // the table count or the format byte
    bytes[rng() % 2] = static_cast<uint8_t>(rng());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--canary") == 0) {  // the sanitizer must stop this
    std::unique_ptr<uint8_t[]> bytes(new uint8_t[16]());
    volatile int64_t past = 16;
    return bytes[past];
  }
  const double seconds = argc > 1 ? std::atof(argv[1]) : 10.0;
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 46;
  std::mt19937_64 rng(seed);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int64_t bodies = 0, faults = 0;
  std::vector<Word> out;
  while (std::chrono::steady_clock::now() < end) {
    const Sample s = encode_random(rng);
    const std::vector<uint8_t> body(s.residual.begin(), s.residual.begin() + s.used);
    if (decode(s.p, s.anchor, body, out) != kFaultNone || out != s.rows) {
      std::fprintf(stderr, "codec_fuzz: a valid body did not decode bit for bit (seed %llu)\n",
                   static_cast<unsigned long long>(seed));
      return 1;
    }
    for (int i = 0; i < 64; ++i) {
      std::vector<uint8_t> mutated = body, anchor = s.anchor;
      if (rng() % 8) {
        mutate(mutated, rng, true);
      } else {
        mutate(anchor, rng, false);
      }
      if (rng() % 4 == 0) mutate(mutated, rng, true);
      faults += decode(s.p, anchor, mutated, out) != kFaultNone;
      ++bodies;
    }
  }
  std::printf("codec_fuzz: %lld bodies, %lld faults, seed %llu\n", static_cast<long long>(bodies),
              static_cast<long long>(faults), static_cast<unsigned long long>(seed));
  return 0;
}
