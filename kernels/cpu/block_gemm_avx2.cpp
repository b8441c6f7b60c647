// The block GEMMs for AVX2 + FMA + F16C (block_gemm_kernel.h): 8 rows a vector, byte dot
// products with vpmaddubsw / vpmaddwd as llama.cpp's AVX2 path does.
#include "block_gemm_isa.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c")
namespace {

struct Avx2 {
  static constexpr int kLanes = 8, kRows = 4, kUnits = 1;
  static constexpr bool kVnni = false;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const I*>(p)); }
  static I bcast(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I zero() { return _mm256_setzero_si256(); }
  static I lo4(I w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
  static I hi4(I w) { return lo4(_mm256_srli_epi16(w, 4)); }
  // INT16 sums: 8 steps of 2 * 15 * 127 stay below 2^15
  static I q4_step(I acc, I w, I x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
  static I q4_finish(I acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
  static I q8_x(I x) { return x; }
  static I q8_step(I acc, I w, I x) {  // 2 * 128 * 127 < 2^15: no saturation
    const I p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F load_half(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};

}  // namespace
#include "block_gemm_kernel.h"

void pipellm::block_gemm::run_avx2(const Args& args) { run_isa<Avx2>(args); }
PIPELLM_TARGET_END
#else
void pipellm::block_gemm::run_avx2(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
