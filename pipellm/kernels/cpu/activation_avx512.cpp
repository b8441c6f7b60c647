// silu_mul's rows on AVX-512 F/BW/VL/DQ, 16 floats a vector with simd_avx512.h's exp (the
// portable loop of activation.cpp vectorizes 8 wide with libmvec's expf):
//   silu(g) * up = g * sigmoid(g) * up, sigmoid from e = exp(-|g|): 1 / (1 + e), or
//   e / (1 + e) where g < 0 (the reciprocal: rcp14 and a Newton step, a few times cheaper than
//   a division); float32, rounded once to the output dtype.
#include "common.h"
#include "isa_target.h"

namespace pipellm::activation {
void silu_mul_avx512(const float* x, int64_t sx, int64_t rows, int64_t inter, float* out);
void silu_mul_avx512(const c10::BFloat16* x, int64_t sx, int64_t rows, int64_t inter,
                     c10::BFloat16* out);
}  // namespace pipellm::activation

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include "simd_avx512.h"

namespace {

using V = Avx512F;

V::F silu_times(V::F g, V::F up) {
  const V::F one = V::set1(1.f);
  const V::F e = V::exp(_mm512_or_ps(g, V::set1(-0.f)));  // e^-|g|
  const V::F d = V::add(one, e);
  const V::F r = _mm512_rcp14_ps(d);  // 1 / d to 2^-14, one Newton step: to about 2^-28
  const V::F pos = V::mul(r, _mm512_fnmadd_ps(d, r, V::set1(2.f)));  // sigmoid(|g|)
  const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(g));
  return V::mul(V::mul(g, _mm512_mask_mul_ps(pos, neg, e, pos)), up);
}

template <typename T>
void rows_of(const T* x, int64_t sx, int64_t rows, int64_t inter, T* out) {
  pipellm::for_row_chunks(rows, 2 * inter, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * sx;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i + V::kLanes <= inter; i += V::kLanes)
        V::store(o + i, silu_times(V::load(g + i), V::load(u + i)));
      for (; i < inter; ++i)
        o[i] = static_cast<T>(pipellm::silu(static_cast<float>(g[i])) *
                              static_cast<float>(u[i]));
    }
  });
}

}  // namespace

void pipellm::activation::silu_mul_avx512(const float* x, int64_t sx, int64_t rows,
                                          int64_t inter, float* out) {
  rows_of(x, sx, rows, inter, out);
}
void pipellm::activation::silu_mul_avx512(const c10::BFloat16* x, int64_t sx, int64_t rows,
                                          int64_t inter, c10::BFloat16* out) {
  rows_of(x, sx, rows, inter, out);
}
PIPELLM_TARGET_END
#else
void pipellm::activation::silu_mul_avx512(const float*, int64_t, int64_t, int64_t, float*) {
  throw std::runtime_error("not an x86 build");
}
void pipellm::activation::silu_mul_avx512(const c10::BFloat16*, int64_t, int64_t, int64_t,
                                          c10::BFloat16*) {
  throw std::runtime_error("not an x86 build");
}
#endif
