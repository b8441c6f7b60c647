// Avx2F: the float vector traits of AVX2 + FMA + F16C (8 floats a vector) that the vectorized
// CPU kernels are templates over (decode_attention_kernel.h, lora_kernel.h). Included inside a
// avx2 target region (isa_target.h), after what the kernel's .cpp includes before it.
#pragma once

#include "simd_math.h"

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
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static void store(c10::BFloat16* p, F v) {  // rounded to nearest even (no NaN care)
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), w);
  }
  static void store(c10::Half* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), 
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static float sum(F v) { return hsum(v); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static float hmax(F v) {  // the largest of v's 8 floats
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  // out[i] = sum(v[i]) for i < 8
  static void sum8(const F* v, float* out) { _mm256_storeu_ps(out, hsum8(v)); }
  // e^x for x <= 0 (simd_math.h)
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
