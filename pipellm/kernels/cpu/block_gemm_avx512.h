// The AVX-512 traits of block_gemm_kernel.h, with and without VNNI (vpdpbusd), 16 rows a
// vector; included by block_gemm_avx512.cpp and block_gemm_avx512_vnni.cpp inside their target
// regions.
#pragma once

#include "simd_avx512.h"

namespace {

template <bool Vnni>
struct Avx512 : Avx512F {
  // two units (tiles) share each broadcast activation; a step of up to kFewRows rows takes one
  // tile an item, so that each thread streams its weights in one run (block_gemm_kernel.h)
  static constexpr int kRows = 4, kUnits = 2, kFewUnits = 1, kFewRows = 8;
  static constexpr bool kVnni = Vnni, kRolled = false;
  using I = __m512i;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I zero() { return _mm512_setzero_si512(); }
  static I lo4(I w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
  static I hi4(I w) { return lo4(_mm512_srli_epi16(w, 4)); }
  static I q4_step(I acc, I w, I x) {
    if constexpr (Vnni) return _mm512_dpbusd_epi32(acc, w, x);
    else return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x));  // see Avx2
  }
  static I q4_finish(I acc) {
    if constexpr (Vnni) return acc;
    else return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
  }
  static I q8_x(I x) {
    if constexpr (Vnni) return _mm512_xor_si512(x, _mm512_set1_epi8(static_cast<char>(0x80)));
    else return x;
  }
  static I q8_step(I acc, I w, I x) {
    if constexpr (Vnni) {
      return _mm512_dpbusd_epi32(acc, x, w);
    } else {  // |w| . (x with w's sign); AVX-512 has no vpsignb
      const I xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), zero(), x);
      const I p = _mm512_maddubs_epi16(_mm512_abs_epi8(w), xs);
      return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
    }
  }
  // the float side: Avx512F's (simd_avx512.h), under the names the kernel uses
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F load_half(const c10::Half* p) { return Avx512F::load(p); }
  static void storef(float* p, F v) { Avx512F::store(p, v); }
};

}  // namespace
