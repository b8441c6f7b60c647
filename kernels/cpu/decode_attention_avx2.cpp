// The decode attention for AVX2 + FMA + F16C: 8 floats a vector (decode_attention_kernel.h).
#include "decode_attention.h"
#include "decode_attention_schedule.h"
#include "isa_target.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c")
#include "decode_attention_simd.h"
namespace {

struct Avx2F {
  static constexpr int kLanes = 8;
  using F = __m256;
  static F fzero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const c10::BFloat16* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static float sum(F v) { return hsum(v); }
  // out[i] = sum(v[i]) for i < 8
  static void sum8(const F* v, float* out) { _mm256_storeu_ps(out, hsum8(v)); }
  // e^x for x <= 0 (decode_attention_simd.h)
  static F exp(F x) {
    const F small = _mm256_cmp_ps(x, set1(kExpMin), _CMP_LT_OQ);
    x = _mm256_max_ps(x, set1(kExpMin));
    const F n = _mm256_round_ps(mul(x, set1(kLog2e)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F r = _mm256_fnmadd_ps(n, set1(kLn2Lo), _mm256_fnmadd_ps(n, set1(kLn2Hi), x));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(small, mul(exp_poly<Avx2F>(r), _mm256_castsi256_ps(e)));
  }
};

}  // namespace
#include "decode_attention_kernel.h"

void pipellm::attention::run_avx2(const Args& args) { run_isa<Avx2F>(args); }
PIPELLM_TARGET_END
#else
void pipellm::attention::run_avx2(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
