// The AVX2 traits of block_gemm_kernel.h, with and without AVX-VNNI (the VEX vpdpbusd of
// Alder Lake, Sierra Forest and Zen 5: 256-bit byte dot products on CPUs that may lack
// AVX-512), 8 rows a vector; included by block_gemm_avx2.cpp and block_gemm_avx2_vnni.cpp
// inside their target regions. Without VNNI: vpmaddubsw / vpmaddwd as llama.cpp's AVX2 path.
#pragma once

#include "simd_avx2.h"

namespace {

template <bool Vnni>
struct Avx2 : Avx2F {
  // without VNNI two units share each broadcast activation (Zen 3 spends a vector port on it)
  static constexpr int kRows = 4, kUnits = Vnni ? 1 : 2, kFewUnits = kUnits, kFewRows = 0;
  static constexpr bool kVnni = Vnni, kRolled = !Vnni;
  using I = __m256i;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I lo4(I w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  static I hi4(I w) { return lo4(_mm256_srli_epi16(w, 4)); }
  // without VNNI, INT16 sums: 8 steps of 2 * 15 * 127 stay below 2^15
  static I q4_step(I acc, I w, I x) {
    if constexpr (Vnni) return _mm256_dpbusd_avx_epi32(acc, w, x);
    else return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x));
  }
  static I q4_finish(I acc) {
    if constexpr (Vnni) return acc;
    else return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
  }
  static I q8_x(I x) {
    if constexpr (Vnni) return _mm256_xor_si256(x, _mm256_set1_epi8(static_cast<char>(0x80)));
    else return x;
  }
  static I q8_step(I acc, I w, I x) {
    if constexpr (Vnni) {  // (x + 128) . w, the block's 128 * sum(w) subtracted after
      return _mm256_dpbusd_avx_epi32(acc, x, w);
    } else {  // |w| . (x with w's sign); 2 * 128 * 127 < 2^15: no saturation
      const I p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
      return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
  }
  // the float side: Avx2F's (simd_avx2.h), under the names the kernel uses
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F load_half(const c10::Half* p) { return Avx2F::load(p); }
  static void storef(float* p, F v) { Avx2F::store(p, v); }
};

}  // namespace
