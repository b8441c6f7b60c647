// RMSNorm, plain, fused with the residual add, and fused with both and the per-token INT8
// quantization (W8A8): the CPU twins of pipellm/kernels/rmsnorm.py's Triton kernel, with its
// rms_norm_ref / add_rms_norm_ref (HF Llama) and rms_norm_int8's reference as references:
//
//   h      = residual + x                         (rounded to x's dtype; only with a residual)
//   normed = w * (h_f32 * rsqrt(mean(h_f32^2) + eps)).to(dtype)    (product rounded once)
//   int8:    quantize_int8_ref(normed)             (pipellm/kernels/int8_quant.py: per-row scale)
//
// x, residual [..., N] (rows may be strided; last dim contiguous), w [N] in x's dtype.
// Each row's x (+ residual) is read once from memory into an fp32 scratch row (residual + x is
// written as it goes); the sum of squares, normalization, weight (and quantization) then run
// over that cache-resident row. Only the order of the fp32 sum of squares differs from torch's
// (an ulp of the variance at most); the rest is bit-identical. bf16 rows without INT8 (N a
// multiple of 16) run norm_avx512.cpp's loop where the kernels' ISA level is an AVX-512 one.
#include "common.h"

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

std::string vector_isa();  // block_gemm.cpp: avx512, avx2 or "" at the chosen level

namespace pipellm::norm {
void rows_bf16_avx512(const c10::BFloat16* x, int64_t sx, const c10::BFloat16* res,
                      int64_t sres, const c10::BFloat16* w, c10::BFloat16* out,
                      c10::BFloat16* res_out, int64_t rows, int64_t n, float eps);
}  // namespace pipellm::norm

namespace {

using pipellm::round_to;

// Pointers of one call; rows of x / residual are sx / sres apart, outputs contiguous [T, n].
template <typename scalar_t>
struct NormArgs {
  const scalar_t* x;
  int64_t sx;
  const scalar_t* res;  // nullptr: no residual
  int64_t sres;
  const scalar_t* w;
  scalar_t* out;      // normed rows (nullptr when quantizing)
  scalar_t* res_out;  // residual + x (nullptr without a residual)
  int8_t* q;          // int8 rows (nullptr unless quantizing)
  float* scales;      // [T] per-row scales (with q)
  int64_t n;
  float eps;
};

// h = x or round(residual + x) into buf [n] (and res_out); returns 1 / rms(h).
template <typename scalar_t>
float load_rstd(const NormArgs<scalar_t>& a, int64_t r, float* buf) {
  const scalar_t* x = a.x + r * a.sx;
  const int64_t n = a.n;
  if (a.res) {
    const scalar_t* res = a.res + r * a.sres;
    scalar_t* ro = a.res_out + r * n;
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(res[i]) + static_cast<float>(x[i]);
    for (int64_t i = 0; i < n; ++i) {  // (two loops: one that keeps a scalar_t h won't vectorize)
      ro[i] = static_cast<scalar_t>(buf[i]);
      buf[i] = round_to<scalar_t>(buf[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(x[i]);
  }
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
  return pipellm::ieee_rstd(ss, static_cast<float>(n), a.eps);
}

template <typename scalar_t>
void norm_row(const NormArgs<scalar_t>& a, int64_t r, float* buf) {
  const float rstd = load_rstd(a, r, buf);
  const int64_t n = a.n;
  // normalized, rounded to x's dtype; a loop of its own, so that -ffast-math cannot reassociate
  // w * (h * rstd) into (w * h) * rstd (float32 rounds differently then)
  for (int64_t i = 0; i < n; ++i) buf[i] = round_to<scalar_t>(buf[i] * rstd);
  if (a.q) {  // the normed row in x's dtype, then quantized (as the reference rounds it)
    for (int64_t i = 0; i < n; ++i)
      buf[i] = round_to<scalar_t>(static_cast<float>(a.w[i]) * buf[i]);
    a.scales[r] = pipellm::quantize_row(buf, n, a.q + r * n);
  } else {
    scalar_t* out = a.out + r * n;
    for (int64_t i = 0; i < n; ++i)
      out[i] = static_cast<scalar_t>(static_cast<float>(a.w[i]) * buf[i]);
  }
}

template <typename scalar_t>
void norm_rows(const NormArgs<scalar_t>& a, int64_t rows) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (!a.q && a.n % 16 == 0 && vector_isa() == "avx512")
      return pipellm::norm::rows_bf16_avx512(a.x, a.sx, a.res, a.sres, a.w, a.out, a.res_out,
                                             rows, a.n, a.eps);
  }
  pipellm::for_row_chunks(rows, a.n, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(a.n);  // per-chunk fp32 scratch row
    for (int64_t r = begin; r < end; ++r) norm_row(a, r, buf.data());
  });
}

// Outputs of one call: normed (or q + scales) [T, N], res_out [T, N] or undefined.
struct NormOut {
  at::Tensor out, res_out, q, scales;
};

NormOut norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
             const at::Tensor& w, double eps, bool quant) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.scalar_type() == x.scalar_type(),
              "weight must be [N] in x's dtype");
  TORCH_CHECK(!residual || (residual->sizes() == x.sizes() &&
                            residual->scalar_type() == x.scalar_type()),
              "residual must have x's shape and dtype");
  const auto xr = pipellm::as_rows(x, n);
  const auto rr = residual ? pipellm::as_rows(*residual, n) : xr;
  const auto wc = w.contiguous();
  const int64_t T = xr.size(0);
  NormOut o;
  if (quant) {
    o.q = at::empty({T, n}, x.options().dtype(at::kChar));
    o.scales = at::empty({T}, x.options().dtype(at::kFloat));
  } else {
    o.out = at::empty(x.sizes(), x.options());
  }
  if (residual) o.res_out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    NormArgs<scalar_t> a{xr.data_ptr<scalar_t>(), xr.stride(0),
                         residual ? rr.data_ptr<scalar_t>() : nullptr, rr.stride(0),
                         wc.data_ptr<scalar_t>(),
                         quant ? nullptr : o.out.data_ptr<scalar_t>(),
                         residual ? o.res_out.data_ptr<scalar_t>() : nullptr,
                         quant ? o.q.data_ptr<int8_t>() : nullptr,
                         quant ? o.scales.data_ptr<float>() : nullptr, n,
                         static_cast<float>(eps)};
    norm_rows(a, T);
  });
  return o;
}

}  // namespace

// x [..., N], w [N] -> w * rmsnorm(x) [..., N] in x's dtype.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  return norm(x, std::nullopt, w, eps, false).out;
}

// x, residual [..., N] -> (rms_norm(residual + x), residual + x); the inputs are not modified.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual,
                                                      at::Tensor w, double eps) {
  auto o = norm(x, residual, w, eps, false);
  return {o.out, o.res_out};
}

// -> (int8 values [T, N], float32 scales [T], residual + x [..., N] or None).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> rms_norm_int8(
    at::Tensor x, std::optional<at::Tensor> residual, at::Tensor w, double eps) {
  auto o = norm(x, residual, w, eps, true);
  std::optional<at::Tensor> res;
  if (residual) res = o.res_out;
  return {o.q, o.scales, res};
}
