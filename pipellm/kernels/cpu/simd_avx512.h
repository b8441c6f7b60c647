// Avx512F: the float vector traits of AVX-512 F/BW/VL/DQ (16 floats a vector) that the vectorized
// CPU kernels are templates over (decode_attention_kernel.h, lora_kernel.h). Included inside an
// avx512 target region (isa_target.h), after what the kernel's .cpp includes before it.
#pragma once

#include "simd_math.h"

namespace {

struct Avx512F {
  static constexpr int kLanes = 16;
  using F = __m512;
  static F fzero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const c10::BFloat16* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F round_bf16(F v) {  // v rounded to bf16 (nearest even, no NaN care), as a float
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(~0xFFFF)));
  }
  static void store(c10::BFloat16* p, F v) {  // round_bf16's value, its upper 16 bits
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store(c10::Half* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static __m256 fold(F v) {  // the sums of v's two halves
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static float sum(F v) { return hsum(fold(v)); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  // out[i] = sum(v[i]) for i < 8
  static void sum8(const F* v, float* out) {
    __m256 h[8];
    for (int i = 0; i < 8; ++i) h[i] = fold(v[i]);
    _mm256_storeu_ps(out, hsum8(h));
  }
  // e^x for x <= 0 (simd_math.h)
  static F exp(F x) {
    const __mmask16 small = _mm512_cmp_ps_mask(x, set1(kExpMin), _CMP_LT_OQ);
    x = _mm512_max_ps(x, set1(kExpMin));
    const F n = _mm512_roundscale_ps(mul(x, set1(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F r = _mm512_fnmadd_ps(n, set1(kLn2Lo), _mm512_fnmadd_ps(n, set1(kLn2Hi), x));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                         _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~small),
                               mul(exp_poly<Avx512F>(r), _mm512_castsi512_ps(e)));
  }
};

}  // namespace
