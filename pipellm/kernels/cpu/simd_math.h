// What the ISA traits of simd_avx2.h and simd_avx512.h share (included inside their target
// regions: AVX2 at least): the constants and polynomial of Cephes'
// expf, and the horizontal sums of 8-float vectors (AVX-512 folds its vectors to them).
#pragma once

namespace {

// e^x = 2^n * e^r, n = round(x * log2 e), r = x - n * ln2 (ln2 in two parts, |r| <= ln2 / 2),
// e^r by a degree-5 polynomial: ~1 ulp. Below kExpMin the result is flushed to 0.
constexpr float kExpMin = -87.3f;
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// e^r for |r| <= ln2 / 2, in V's vectors
template <class V>
inline typename V::F exp_poly(typename V::F r) {
  typename V::F y = V::set1(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = V::fmadd(y, r, V::set1(kExpPoly[i]));
  return V::fmadd(y, V::mul(r, r), V::add(r, V::set1(1.f)));
}

// the sum of v's 8 floats
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// [sum(v[0]), ..., sum(v[7])]
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low and high 128-bit halves' sums), b: s4..s7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

}  // namespace
