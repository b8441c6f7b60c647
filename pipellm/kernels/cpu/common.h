// Helpers shared by the row kernels (norm.cpp, activation.cpp, int8_quant.cpp, rope.cpp).
//
// A row kernel reads [T, n] rows (last dim contiguous, rows any stride apart), computes in
// float32 and rounds to the output dtype where its PyTorch reference does. Rows run in parallel
// on ATen's thread pool in chunks of at least kGrainElems elements: a decode step's few rows
// (T = 1) run inline on the calling thread, without the pool's wake-up cost.

#pragma once

#include <ATen/Parallel.h>
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pipellm {

constexpr int64_t kGrainElems = 16384;

// f(begin, end) over row chunks [begin, end) of rows [0, rows), each row_elems long.
template <typename F>
inline void for_row_chunks(int64_t rows, int64_t row_elems, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1));
  at::parallel_for(0, rows, grain, f);
}

// t [..., n] as [T, n] rows with a contiguous last dim (a view when possible).
inline at::Tensor as_rows(const at::Tensor& t, int64_t n) {
  auto rows = t.reshape({-1, n});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

// x rounded to scalar_t and back: the reference's intermediate `.to(dtype)`.
template <typename scalar_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<scalar_t>(x));
}

// IEEE arithmetic where a reference's roundings must be matched bit for bit. Under -ffast-math
// (-funsafe-math-optimizations) GCC may turn v / s in a loop into v * (1 / s), fold
// v / (amax / 127) into v * 127 / amax, or use reciprocal estimates: each moves INT8 values at
// rounding ties by a step, or a scale by an ulp. These functions are compiled without it; they
// take plain floats (an inlined bf16 conversion would clash with the attribute) and are called
// once per row or head.
#if defined(__GNUC__) && !defined(__clang__)
#define PIPELLM_IEEE __attribute__((noinline, optimize("no-unsafe-math-optimizations")))
#else
#define PIPELLM_IEEE __attribute__((noinline))
#endif

PIPELLM_IEEE inline float ieee_div(float a, float b) { return a / b; }

// 1 / sqrt(ss / n + eps): RMSNorm's rsqrt(mean(h^2) + eps) as torch computes it on a CPU.
PIPELLM_IEEE inline float ieee_rstd(float ss, float n, float eps) {
  return 1.f / std::sqrt(ss / n + eps);
}

// x[i] /= s[i / group] for i < n, or 0 where s[i / group] is 0 (n a multiple of group).
// (Unconditional inner loops: this code may not if-convert a division, which would stop it from
// vectorizing.)
PIPELLM_IEEE inline void ieee_div_groups(float* x, int64_t n, const float* s, int64_t group) {
  for (int64_t g = 0; g < n / group; ++g) {
    float* xg = x + g * group;
    const float sg = s[g];
    if (sg > 0.f) {
      for (int64_t i = 0; i < group; ++i) xg[i] /= sg;
    } else {
      for (int64_t i = 0; i < group; ++i) xg[i] = 0.f;
    }
  }
}

// q rounded half away from zero and clamped to [-127, 127] (the INT8 rules of
// pipellm/kernels/int8_quant.py and pipellm/kernels/kv_quant.py).
inline int8_t to_int8(float q) {
  const float r = q >= 0.f ? std::floor(q + 0.5f) : -std::floor(-q + 0.5f);
  return static_cast<int8_t>(std::min(std::max(r, -127.f), 127.f));
}

// silu(g) = g / (1 + exp(-g)), as torch's F.silu computes it.
inline float silu(float g) {
  return g / (1.f + std::exp(-g));
}

// Row x [n] -> q [n] int8 with one scale = max |x| / 127 (0 for a row of zeros, its values 0);
// returns the scale. pipellm/kernels/int8_quant.py's quantize_int8_ref, bit for bit. x is overwritten.
inline float quantize_row(float* x, int64_t n, int8_t* q) {
  if (n == 0) return 0.f;
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(x[i]));
  const float scale = ieee_div(amax, 127.f);
  ieee_div_groups(x, n, &scale, n);
  for (int64_t i = 0; i < n; ++i) q[i] = to_int8(x[i]);
  return scale;
}

}  // namespace pipellm
