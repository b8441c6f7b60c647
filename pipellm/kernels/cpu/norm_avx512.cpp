// RMSNorm's bf16 rows (plain and fused with the residual add, no INT8) on AVX-512 F/BW/VL/DQ, 16
// at a time, with norm.cpp's roundings (each to bf16, to nearest even, in registers):
//   h = bf16(residual + x) (also written out), rstd = 1 / sqrt(mean(h^2) + eps),
//   out = bf16(w * bf16(h * rstd)).
// Only the order of the float32 sum of squares differs from the portable loop's. n % 16 == 0.
#include "common.h"
#include "isa_target.h"

namespace pipellm::norm {
void rows_bf16_avx512(const c10::BFloat16* x, int64_t sx, const c10::BFloat16* res,
                      int64_t sres, const c10::BFloat16* w, c10::BFloat16* out,
                      c10::BFloat16* res_out, int64_t rows, int64_t n, float eps);
}  // namespace pipellm::norm

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include "simd_avx512.h"

namespace {

using V = Avx512F;
using bf16 = c10::BFloat16;

// one row: h into buf (rounded), written to res_out with a residual; then the normed row
void row(const bf16* x, const bf16* res, const bf16* w, bf16* out, bf16* res_out, int64_t n,
         float eps, float* buf) {
  V::F ss = V::fzero();
  for (int64_t i = 0; i < n; i += V::kLanes) {
    V::F h = V::load(x + i);
    if (res) {
      h = V::round_bf16(V::add(V::load(res + i), h));
      V::store(res_out + i, h);  // exact: h is a bf16 value already
    }
    V::store(buf + i, h);
    ss = V::fmadd(h, h, ss);
  }
  const V::F rstd = V::set1(pipellm::ieee_rstd(V::sum(ss), static_cast<float>(n), eps));
  for (int64_t i = 0; i < n; i += V::kLanes)
    V::store(out + i,
             V::mul(V::load(w + i), V::round_bf16(V::mul(V::loadf(buf + i), rstd))));
}

}  // namespace

void pipellm::norm::rows_bf16_avx512(const bf16* x, int64_t sx, const bf16* res, int64_t sres,
                                     const bf16* w, bf16* out, bf16* res_out, int64_t rows,
                                     int64_t n, float eps) {
  pipellm::for_row_chunks(rows, n, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r)
      row(x + r * sx, res ? res + r * sres : nullptr, w, out + r * n,
          res ? res_out + r * n : nullptr, n, eps, buf.data());
  });
}
PIPELLM_TARGET_END
#else
void pipellm::norm::rows_bf16_avx512(const c10::BFloat16*, int64_t, const c10::BFloat16*,
                                     int64_t, const c10::BFloat16*, c10::BFloat16*,
                                     c10::BFloat16*, int64_t, int64_t, float) {
  throw std::runtime_error("not an x86 build");
}
#endif
