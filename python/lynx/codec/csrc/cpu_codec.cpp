// Python bindings of the fused CPU codec (kernels in cpu_codec_kernels.h): argument checks,
// padding, dtype dispatch.
#include <torch/extension.h>

#include "cpu_codec_kernels.h"
#include "cpu_codec_lossless.h"

namespace {

using namespace lynx_codec;

// One part's geometry: rows[slots] (all rows without slots) as an (n, channels) part.
Part make_part(const torch::Tensor& rows, const c10::optional<torch::Tensor>& slots, bool per_channel,
               int64_t group_size, int64_t key_block, int64_t bits, bool exact, int64_t scales_offset,
               int64_t codes_offset) {
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(bits >= 2 && bits <= 4, "anchor bits must be 2..4, got ", bits);
  TORCH_CHECK(group_size > 0 && key_block > 0, "group_size and key_block must be positive");
  Part p;
  p.channels = rows.size(1);
  // Whole bytes per token row for the Anchor codes and the Residual bits; whole groups.
  TORCH_CHECK(p.channels > 0 && p.channels % 8 == 0, "a part needs a positive multiple of 8 channels, got ",
              p.channels);
  TORCH_CHECK(per_channel || p.channels % group_size == 0, "group_size ", group_size, " does not divide ",
              p.channels, " channels");
  p.slots = nullptr;
  p.n = rows.size(0);
  if (slots.has_value()) {
    TORCH_CHECK(slots->device().is_cpu() && slots->dtype() == torch::kInt64 && slots->dim() == 1 &&
                    slots->is_contiguous(),
                "slots must be a contiguous 1-D int64 CPU tensor");
    p.slots = slots->data_ptr<int64_t>();
    p.n = slots->numel();
    const int64_t limit = rows.size(0);
    for (int64_t i = 0; i < p.n; ++i)
      TORCH_CHECK(p.slots[i] >= 0 && p.slots[i] < limit, "slot ", p.slots[i], " (token ", i,
                  ") is outside the ", limit, " rows");
  }
  p.per_channel = per_channel;
  p.group_size = group_size;
  p.key_block = key_block;
  p.bits = bits;
  p.exact = exact;
  p.scales_offset = scales_offset;
  p.codes_offset = codes_offset;
  return p;
}

void check_bytes(const torch::Tensor& buf) {
  TORCH_CHECK(buf.device().is_cpu() && buf.dtype() == torch::kUInt8 && buf.dim() == 1 && buf.is_contiguous(),
              "codec buffers must be contiguous 1-D uint8 CPU tensors");
}

// The bytes of the group minimums (and, as many, of the scales) the kernels read or write
// for part p: one word per channel per key block, or per group of each token.
int64_t param_nbytes_of(const Part& p, int64_t itemsize) {
  const int64_t params = p.per_channel ? (p.n + p.key_block - 1) / p.key_block * p.channels
                                       : p.n * (p.channels / p.group_size);
  return params * itemsize;
}

// The Anchor of part p holds its minimums at 0, scales at scales_offset and codes at
// codes_offset, in that order, each within the buffer; param_nbytes: the minimums' bytes
// as the caller laid them out, at least what the kernels touch.
void check_anchor(const Part& p, int64_t param_nbytes, int64_t itemsize, const torch::Tensor& anchor) {
  TORCH_CHECK(param_nbytes >= param_nbytes_of(p, itemsize), "anchor parameters of ", param_nbytes,
              " bytes, the part's geometry needs ", param_nbytes_of(p, itemsize));
  TORCH_CHECK(p.scales_offset >= param_nbytes && p.codes_offset >= p.scales_offset + param_nbytes,
              "anchor offsets out of order: minimums of ", param_nbytes, " bytes, scales at ", p.scales_offset,
              ", codes at ", p.codes_offset);
  TORCH_CHECK(p.codes_offset + p.n * p.channels * p.bits / 8 <= anchor.numel(), "anchor buffer of ",
              anchor.numel(), " bytes too small for ", p.n, " tokens of ", p.channels, " channels");
}

// A Residual buffer holds what the kernels read or write of part p: a lossless one its
// capacity (encode) or any length (decode: the coder checks it); a fixed-width one the
// residual bits of every value.
void check_residual(const Part& p, const torch::Tensor& residual) {
  check_bytes(residual);
  TORCH_CHECK(p.exact || p.n * p.channels * p.rbits() / 8 <= residual.numel(), "residual buffer of ",
              residual.numel(), " bytes too small for ", p.n, " tokens of ", p.channels, " channels");
}

// Zero the alignment padding of a part (everything its arrays do not cover).
void zero_padding(const Part& p, int64_t param_nbytes, int64_t itemsize, torch::Tensor& anchor,
                  torch::Tensor& residual) {
  uint8_t* a = anchor.data_ptr<uint8_t>();
  const int64_t codes_end = p.codes_offset + p.n * p.channels * p.bits / 8;
  std::memset(a + param_nbytes, 0, p.scales_offset - param_nbytes);
  std::memset(a + p.scales_offset + param_nbytes, 0, p.codes_offset - p.scales_offset - param_nbytes);
  std::memset(a + codes_end, 0, anchor.numel() - codes_end);
  if (p.exact) return;  // the lossless coder writes its whole capacity
  const int64_t residual_end = p.n * p.channels * p.rbits() / 8;
  std::memset(residual.data_ptr<uint8_t>() + residual_end, 0, residual.numel() - residual_end);
}

template <typename D>
std::vector<int64_t> encode_typed(const std::vector<Part>& parts, const std::vector<torch::Tensor>& rows,
                                  std::vector<torch::Tensor>& anchors, std::vector<torch::Tensor>& residuals,
                                  int threads) {
  std::vector<EncodeJob<D>> jobs;
  for (size_t i = 0; i < parts.size(); ++i)
    jobs.push_back({parts[i], reinterpret_cast<const typename D::Word*>(rows[i].data_ptr()),
                    anchors[i].data_ptr<uint8_t>(), residuals[i].data_ptr<uint8_t>()});
  const std::vector<bool> finite = encode_parts(jobs, threads);
  if (parts[0].exact) return encode_lossless_parts(jobs, finite, threads);
  std::vector<int64_t> used;
  for (size_t i = 0; i < parts.size(); ++i) used.push_back(finite[i] ? residuals[i].numel() : -1);
  return used;
}

// Encode parts i = rows[i][slots] (same slots, config and dtype; per-part key/value kind and
// offsets): the Anchors in one parallel region, lossless Residuals in a second. Per part,
// the Residual bytes written, -1 if its input was not finite.
std::vector<int64_t> encode_rows(std::vector<torch::Tensor> rows, c10::optional<torch::Tensor> slots,
                              std::vector<bool> per_channel, int64_t group_size, int64_t key_block, int64_t bits,
                              bool exact, std::vector<int64_t> param_nbytes, std::vector<int64_t> scales_offset,
                              std::vector<int64_t> codes_offset, std::vector<torch::Tensor> anchors,
                              std::vector<torch::Tensor> residuals, int64_t threads) {
  const size_t count = rows.size();
  TORCH_CHECK(count > 0 && per_channel.size() == count && param_nbytes.size() == count &&
                  scales_offset.size() == count && codes_offset.size() == count && anchors.size() == count &&
                  residuals.size() == count,
              "one entry per part in every list");
  std::vector<Part> parts;
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(rows[i].scalar_type() == rows[0].scalar_type(), "all parts must share a dtype");
    Part p = make_part(rows[i], slots, per_channel[i], group_size, key_block, bits, exact, scales_offset[i],
                       codes_offset[i]);
    check_bytes(anchors[i]);
    check_anchor(p, param_nbytes[i], rows[i].element_size(), anchors[i]);
    check_residual(p, residuals[i]);
    TORCH_CHECK(!exact || residuals[i].numel() == 1 + p.n * p.channels * rows[i].element_size(),
                "a lossless residual buffer holds 1 + the part's raw bytes");
    zero_padding(p, param_nbytes[i], rows[i].element_size(), anchors[i], residuals[i]);
    parts.push_back(p);
  }
  if (parts[0].n == 0) {
    for (auto& residual : residuals)
      if (exact) residual.data_ptr<uint8_t>()[0] = kRawBody;
    return std::vector<int64_t>(count, exact ? 1 : 0);
  }
  const int nthreads = static_cast<int>(std::max<int64_t>(1, threads));
  switch (rows[0].scalar_type()) {
    case torch::kBFloat16:
      return encode_typed<BF16>(parts, rows, anchors, residuals, nthreads);
    case torch::kHalf:
      return encode_typed<FP16>(parts, rows, anchors, residuals, nthreads);
    case torch::kFloat:
      return encode_typed<FP32>(parts, rows, anchors, residuals, nthreads);
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", rows[0].scalar_type());
  }
}

template <typename D>
std::vector<int64_t> decode_typed(const std::vector<Part>& parts, const std::vector<torch::Tensor>& anchors,
                                  const c10::optional<std::vector<torch::Tensor>>& residuals,
                                  std::vector<torch::Tensor>& rows, int threads) {
  std::vector<DecodeJob<D>> jobs;
  for (size_t i = 0; i < parts.size(); ++i)
    jobs.push_back({parts[i], anchors[i].data_ptr<uint8_t>(),
                    residuals.has_value() ? (*residuals)[i].data_ptr<uint8_t>() : nullptr,
                    reinterpret_cast<typename D::Word*>(rows[i].data_ptr())});
  if (residuals.has_value() && parts[0].exact) {
    std::vector<int64_t> lengths;
    for (const auto& residual : *residuals) lengths.push_back(residual.numel());
    return decode_lossless_parts(jobs, lengths, threads);
  }
  decode_parts(jobs, threads);
  return std::vector<int64_t>(parts.size(), kFaultNone);
}

// Decode parts i into rows[i][slots] in one parallel region (residuals None: Anchor only);
// per part a ResidualFault (a lossless Residual: no row is written unless every part is sound).
std::vector<int64_t> decode_rows(std::vector<torch::Tensor> anchors, c10::optional<std::vector<torch::Tensor>> residuals,
                 std::vector<torch::Tensor> rows, c10::optional<torch::Tensor> slots, std::vector<bool> per_channel,
                 int64_t group_size, int64_t key_block, int64_t bits, bool exact, std::vector<int64_t> scales_offset,
                 std::vector<int64_t> codes_offset, int64_t threads) {
  const size_t count = rows.size();
  TORCH_CHECK(count > 0 && per_channel.size() == count && scales_offset.size() == count &&
                  codes_offset.size() == count && anchors.size() == count &&
                  (!residuals.has_value() || residuals->size() == count),
              "one entry per part in every list");
  std::vector<Part> parts;
  for (size_t i = 0; i < count; ++i) {
    TORCH_CHECK(rows[i].scalar_type() == rows[0].scalar_type(), "all parts must share a dtype");
    const Part p = make_part(rows[i], slots, per_channel[i], group_size, key_block, bits, exact, scales_offset[i],
                             codes_offset[i]);
    check_bytes(anchors[i]);
    const int64_t itemsize = rows[i].element_size();
    check_anchor(p, param_nbytes_of(p, itemsize), itemsize, anchors[i]);
    if (residuals.has_value()) check_residual(p, (*residuals)[i]);
    parts.push_back(p);
  }
  if (parts[0].n == 0) return std::vector<int64_t>(count, kFaultNone);
  const int nthreads = static_cast<int>(std::max<int64_t>(1, threads));
  switch (rows[0].scalar_type()) {
    case torch::kBFloat16:
      return decode_typed<BF16>(parts, anchors, residuals, rows, nthreads);
    case torch::kHalf:
      return decode_typed<FP16>(parts, anchors, residuals, rows, nthreads);
    case torch::kFloat:
      return decode_typed<FP32>(parts, anchors, residuals, rows, nthreads);
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", rows[0].scalar_type());
  }
}

// `like` only carries the KV dtype.
int64_t anchor_fault(torch::Tensor anchor, torch::Tensor like, int64_t groups, int64_t scales_offset) {
  check_bytes(anchor);
  TORCH_CHECK(scales_offset + groups * like.element_size() <= anchor.numel(), "anchor buffer too small");
  const uint8_t* a = anchor.data_ptr<uint8_t>();
  switch (like.scalar_type()) {
    case torch::kBFloat16:
      return lynx_codec::anchor_params_fault<BF16>(a, groups, scales_offset);
    case torch::kHalf:
      return lynx_codec::anchor_params_fault<FP16>(a, groups, scales_offset);
    case torch::kFloat:
      return lynx_codec::anchor_params_fault<FP32>(a, groups, scales_offset);
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", like.scalar_type());
  }
}

// Huffman code lengths and canonical codes (bit-reversed) of each row of counts (int64,
// (tables, symbols)), as lossless.code_lengths and lossless.canonical_codes make them: for
// a device coder, whose histograms come to the host.
std::vector<torch::Tensor> huffman_codes(torch::Tensor counts) {
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == torch::kLong && counts.dim() == 2 &&
                  counts.is_contiguous() && counts.size(1) <= kMaxSymbols,
              "counts must be a contiguous (tables, <= ", kMaxSymbols, ") int64 CPU tensor");
  const int64_t tables = counts.size(0);
  const int symbols = static_cast<int>(counts.size(1));
  torch::Tensor lengths = torch::zeros({tables, symbols}, torch::kUInt8);
  torch::Tensor codes = torch::zeros({tables, symbols}, torch::kInt32);
  const int64_t* c = counts.data_ptr<int64_t>();
  uint8_t* len = lengths.data_ptr<uint8_t>();
  int32_t* out = codes.data_ptr<int32_t>();
  for (int64_t t = 0; t < tables; ++t) {
    code_lengths(c + t * symbols, symbols, len + t * symbols);
    uint16_t code[kMaxSymbols] = {};
    canonical_codes(len + t * symbols, symbols, code);
    for (int s = 0; s < symbols; ++s) out[t * symbols + s] = code[s];
  }
  return {lengths, codes};
}

}  // namespace

// setup.py defines the digest of the sources and flags (lynx/codec/cpp_build.py); the loader
// compares it with the installed sources' so that a stale build is never used.
#ifndef LYNX_CODEC_DIGEST
#error "build the codec with setup.py (pip install --no-build-isolation), which defines LYNX_CODEC_DIGEST"
#endif
#define LYNX_STRINGIFY_(x) #x
#define LYNX_STRINGIFY(x) LYNX_STRINGIFY_(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("source_digest") = LYNX_STRINGIFY(LYNX_CODEC_DIGEST);
  // The coders touch no Python object: other threads (the lanes' driver, upstream's
  // transfer workers, the receiver) run while they work, e.g. while prefill encodes a
  // request's Residuals after its Anchor and first token left.
  m.def("encode_rows", &encode_rows, py::call_guard<py::gil_scoped_release>(),
        "Encode parts rows[i][slots]; per part its Residual bytes, -1 if not finite");
  m.def("decode_rows", &decode_rows, py::call_guard<py::gil_scoped_release>(),
        "Decode parts into rows[i][slots]; per part a residual fault code");
  m.def("anchor_params_fault", &anchor_fault, "0, or why an anchor's minimums/scales are corrupt");
  m.def("huffman_codes", &huffman_codes, "Code lengths and canonical codes of each row of counts");
  m.def("reciprocal_division_mismatches", &lynx_codec::reciprocal_division_mismatches,
        "Significand pairs where the encoder's reciprocal division differs from a division");
}
