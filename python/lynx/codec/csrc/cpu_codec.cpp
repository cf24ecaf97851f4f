// Python bindings of the fused CPU codec (kernels in cpu_codec_kernels.h): argument checks,
// padding, dtype dispatch.
#include <torch/extension.h>

#include "cpu_codec_kernels.h"

namespace {

using namespace lynx_codec;

Part make_part(const torch::Tensor& rows, const c10::optional<torch::Tensor>& slots, bool per_channel,
               int64_t group_size, int64_t key_block, int64_t bits, bool exact, int64_t scales_offset,
               int64_t codes_offset, int64_t threads) {
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 2 && rows.is_contiguous(),
              "rows must be a contiguous 2-D CPU tensor");
  Part p;
  p.channels = rows.size(1);
  p.slots = nullptr;
  p.n = rows.size(0);
  if (slots.has_value()) {
    TORCH_CHECK(slots->dtype() == torch::kInt64 && slots->dim() == 1 && slots->is_contiguous(),
                "slots must be a contiguous 1-D int64 tensor");
    p.slots = slots->data_ptr<int64_t>();
    p.n = slots->numel();
  }
  p.per_channel = per_channel;
  p.group_size = group_size;
  p.key_block = key_block;
  p.bits = bits;
  p.exact = exact;
  p.scales_offset = scales_offset;
  p.codes_offset = codes_offset;
  p.threads = static_cast<int>(std::max<int64_t>(1, threads));
  return p;
}

void check_bytes(const torch::Tensor& buf) {
  TORCH_CHECK(buf.device().is_cpu() && buf.dtype() == torch::kUInt8 && buf.dim() == 1 && buf.is_contiguous(),
              "codec buffers must be contiguous 1-D uint8 CPU tensors");
}

// Zero the alignment padding of a part (everything its arrays do not cover).
void zero_padding(const Part& p, int64_t param_nbytes, int64_t itemsize, torch::Tensor& anchor,
                  torch::Tensor& residual) {
  uint8_t* a = anchor.data_ptr<uint8_t>();
  const int64_t codes_end = p.codes_offset + p.n * p.channels * p.bits / 8;
  std::memset(a + param_nbytes, 0, p.scales_offset - param_nbytes);
  std::memset(a + p.scales_offset + param_nbytes, 0, p.codes_offset - p.scales_offset - param_nbytes);
  std::memset(a + codes_end, 0, anchor.numel() - codes_end);
  const int64_t residual_end = p.exact ? p.n * p.channels * itemsize : p.n * p.channels * p.rbits() / 8;
  std::memset(residual.data_ptr<uint8_t>() + residual_end, 0, residual.numel() - residual_end);
}

bool encode_rows(torch::Tensor rows, c10::optional<torch::Tensor> slots, bool per_channel, int64_t group_size,
                 int64_t key_block, int64_t bits, bool exact, int64_t param_nbytes, int64_t scales_offset,
                 int64_t codes_offset, torch::Tensor anchor, torch::Tensor residual,
                 int64_t threads) {
  Part p = make_part(rows, slots, per_channel, group_size, key_block, bits, exact, scales_offset, codes_offset,
                     threads);
  check_bytes(anchor);
  check_bytes(residual);
  TORCH_CHECK(codes_offset + p.n * p.channels * bits / 8 <= anchor.numel(), "anchor buffer too small");
  zero_padding(p, param_nbytes, rows.element_size(), anchor, residual);
  uint8_t* r = residual.data_ptr<uint8_t>();
  if (p.n == 0) return true;
  uint8_t* a = anchor.data_ptr<uint8_t>();
  switch (rows.scalar_type()) {
    case torch::kBFloat16:
      return encode_impl<BF16>(p, reinterpret_cast<const uint16_t*>(rows.data_ptr()), a, r);
    case torch::kHalf:
      return encode_impl<FP16>(p, reinterpret_cast<const uint16_t*>(rows.data_ptr()), a, r);
    case torch::kFloat:
      return encode_impl<FP32>(p, reinterpret_cast<const uint32_t*>(rows.data_ptr()), a, r);
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", rows.scalar_type());
  }
}

void decode_rows(torch::Tensor anchor, c10::optional<torch::Tensor> residual, torch::Tensor rows,
                 c10::optional<torch::Tensor> slots, bool per_channel, int64_t group_size, int64_t key_block,
                 int64_t bits, bool exact, int64_t scales_offset, int64_t codes_offset, int64_t threads) {
  Part p = make_part(rows, slots, per_channel, group_size, key_block, bits, exact, scales_offset, codes_offset,
                     threads);
  check_bytes(anchor);
  const uint8_t* r = nullptr;
  if (residual.has_value()) {
    check_bytes(*residual);
    r = residual->data_ptr<uint8_t>();
  }
  if (p.n == 0) return;
  const uint8_t* a = anchor.data_ptr<uint8_t>();
  switch (rows.scalar_type()) {
    case torch::kBFloat16:
      return decode_impl<BF16>(p, a, r, reinterpret_cast<uint16_t*>(rows.data_ptr()));
    case torch::kHalf:
      return decode_impl<FP16>(p, a, r, reinterpret_cast<uint16_t*>(rows.data_ptr()));
    case torch::kFloat:
      return decode_impl<FP32>(p, a, r, reinterpret_cast<uint32_t*>(rows.data_ptr()));
    default:
      TORCH_CHECK(false, "unsupported KV dtype ", rows.scalar_type());
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_rows", &encode_rows, "Encode rows[slots] as one part; returns False on non-finite input");
  m.def("decode_rows", &decode_rows, "Decode one part into rows[slots]");
  m.def("anchor_params_fault", &anchor_fault, "0, or why an anchor's minimums/scales are corrupt");
}
