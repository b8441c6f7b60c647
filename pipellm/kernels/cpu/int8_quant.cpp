// Per-token dynamic INT8 activations (W8A8): the CPU twins of pipellm/kernels/int8_quant.py's Triton
// kernel, with quantize_int8_ref and silu_mul_int8_ref as references. (The third producer,
// RMSNorm fused with the quantization, lives with the norm: norm.cpp.)
//
// quantize_int8: x [..., K] -> (int8 values [T, K], float32 scales [T]), T = x.numel() / K.
// silu_mul_int8: gate_up [..., 2I] -> quantize_int8(silu(gate) * up) as [T, I] rows, the
//   product in float32 (never rounded to the activation dtype).
// Each row: scale = max |x| / 127, values round(x / scale) half away from zero, in [-127, 127];
// a row of zeros has scale 0 and values 0. Rows may be strided (last dim contiguous).
//
// Both are bit-identical to their references. silu(gate) comes from torch's own kernel
// (at::silu, one call on the gate half): an exp that rounds differently by an ulp (ours, the
// compiler's vector expf, vs torch's) moves values at rounding ties by a step, and W8A8's greedy
// output is sensitive to that (tests/test_quantization.py's answers). The product, the row
// maxima and the quantization are ours, fused in one pass over each row.
#include <ATen/ops/silu.h>

#include "common.h"

#include <tuple>
#include <vector>

namespace {

// Rows x [T, sx apart] -> q [T, k] and scales [T]. Without act, row r is quantized as it is;
// with act (silu(gate) float32 [T, k], rows s_act apart), row r is gate | up [2k] and the
// quantized row is act[r] * up.
template <typename scalar_t>
void quant_rows(const scalar_t* x, int64_t sx, int64_t rows, int64_t k, const float* act,
                int64_t s_act, int8_t* q, float* scales) {
  pipellm::for_row_chunks(rows, act ? 2 * k : k, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(k);  // per-chunk fp32 scratch row
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = x + r * sx;
      if (act) {
        const float* a = act + r * s_act;
        for (int64_t i = 0; i < k; ++i) buf[i] = a[i] * static_cast<float>(row[k + i]);
      } else {
        for (int64_t i = 0; i < k; ++i) buf[i] = static_cast<float>(row[i]);
      }
      scales[r] = pipellm::quantize_row(buf.data(), k, q + r * k);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, bool silu_mul) {
  const int64_t width = x.size(-1);
  TORCH_CHECK(!silu_mul || width % 2 == 0, "last dim of gate_up is odd");
  const int64_t k = silu_mul ? width / 2 : width;
  const auto rows = pipellm::as_rows(x, width);  // [T, width]
  const int64_t T = rows.size(0);
  // silu(gate) [T, k] float32, as the reference computes it (gate_up.float(), then F.silu)
  const auto act = silu_mul ? at::silu(rows.narrow(1, 0, k).to(at::kFloat)) : at::Tensor();
  TORCH_CHECK(!act.defined() || act.size(1) <= 1 || act.stride(1) == 1, "silu rows not dense");
  auto q = at::empty({T, k}, x.options().dtype(at::kChar));
  auto scales = at::empty({T}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_int8",
                                  [&] {
    quant_rows(rows.data_ptr<scalar_t>(), rows.stride(0), T, k,
               act.defined() ? act.data_ptr<float>() : nullptr,
               act.defined() ? act.stride(0) : 0, q.data_ptr<int8_t>(), scales.data_ptr<float>());
  });
  return {q, scales};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_int8(at::Tensor x) {
  return quantize(x, false);
}

std::tuple<at::Tensor, at::Tensor> silu_mul_int8(at::Tensor gate_up) {
  return quantize(gate_up, true);
}
