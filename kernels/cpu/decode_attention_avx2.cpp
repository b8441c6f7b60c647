// The decode attention for AVX2 + FMA + F16C: 8 floats a vector (decode_attention_kernel.h).
#include "decode_attention.h"
#include "isa_target.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c")
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
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // out[i] = sum(v[i]) for i < 8
  static void sum8(const F* v, float* out) { _mm256_storeu_ps(out, hsum8(v)); }
  static __m256 hsum8(const __m256* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // a = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves' sums), b: s4..s7
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  // e^x for x <= 0 (Cephes' expf: 2^n * e^r, |r| <= ln2 / 2, degree-5 polynomial; ~1 ulp);
  // below -87.3 the result is flushed to 0
  static F exp(F x) {
    const F lo = _mm256_set1_ps(-87.3f);
    const F small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const F n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    F r = _mm256_fnmadd_ps(n, set1(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, set1(-2.12194440e-4f), r);
    F y = set1(1.9875691500e-4f);
    y = fmadd(y, r, set1(1.3981999507e-3f));
    y = fmadd(y, r, set1(8.3334519073e-3f));
    y = fmadd(y, r, set1(4.1665795894e-2f));
    y = fmadd(y, r, set1(1.6666665459e-1f));
    y = fmadd(y, r, set1(5.0000001201e-1f));
    y = fmadd(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, set1(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(small, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
};

}  // namespace
#include "decode_attention_kernel.h"

void pipellm::attention::run_avx2(const Args& args) { run_isa<Avx2F>(args); }
PIPELLM_TARGET_END
#else
void pipellm::attention::run_avx2(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
