// SiLU x mul of the fused gate/up projection: the CPU twin of pipellm/kernels/activation.py's Triton
// kernel (reference: silu_mul_ref, F.silu(gate) * up).
//
// gate_up [..., 2I] (gate | up halves; rows may be strided, last dim contiguous)
// -> out [..., I] = silu(gate) * up, contiguous, in gate_up's dtype.
// Computed in float32 and rounded once, as the Triton kernel does: bit-equal to the reference
// in float32 but for exp's implementation (a few ulp); in fp16/bf16 the reference rounds twice
// (silu, then the product), so the two differ by ~1 ulp on some elements. float32 and bf16 rows
// run activation_avx512.cpp's loop where the kernels' ISA level is an AVX-512 one.
#include "common.h"

#include <string>
#include <type_traits>

std::string vector_isa();  // block_gemm.cpp: avx512, avx2 or "" at the chosen level

namespace pipellm::activation {
void silu_mul_avx512(const float* x, int64_t sx, int64_t rows, int64_t inter, float* out);
void silu_mul_avx512(const c10::BFloat16* x, int64_t sx, int64_t rows, int64_t inter,
                     c10::BFloat16* out);
}  // namespace pipellm::activation

namespace {

template <typename scalar_t>
void silu_mul_rows(const scalar_t* x, int64_t sx, int64_t rows, int64_t inter, scalar_t* out) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    if (vector_isa() == "avx512")
      return pipellm::activation::silu_mul_avx512(x, sx, rows, inter, out);
  }
  pipellm::for_row_chunks(rows, 2 * inter, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = x + r * sx;
      const scalar_t* u = g + inter;
      scalar_t* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i)
        o[i] = static_cast<scalar_t>(pipellm::silu(static_cast<float>(g[i])) *
                                     static_cast<float>(u[i]));
    }
  });
}

}  // namespace

at::Tensor silu_mul(at::Tensor gate_up) {
  const int64_t two_i = gate_up.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "last dim of gate_up is odd");
  const int64_t inter = two_i / 2;
  const auto x = pipellm::as_rows(gate_up, two_i);  // [T, 2I]
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());  // [..., I]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    silu_mul_rows(x.data_ptr<scalar_t>(), x.stride(0), x.size(0), inter,
                  out.data_ptr<scalar_t>());
  });
  return out;
}
