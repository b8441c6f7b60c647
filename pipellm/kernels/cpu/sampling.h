// The token sampler's shared parts (sampling.cpp: the sampler and its race; sampling_filters.cpp:
// top-k / top-p): a sampled row as both see it, the candidates, and the noise.
//
// Logits are float32 >= kFloor (-inf raised to it: no infinity reaches the arithmetic, which is
// built with -ffinite-math-only). The noise is pipellm/kernels/sampling.py's `uniform_noise`, bit for
// bit (uint32 murmur3 fmix32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace pipellm::sampling {

constexpr int64_t kBlock = 64;    // tokens per block (block maxima, skipping, vector loops)
constexpr float kFloor = -1e30f;  // stands for -inf: exp(kFloor - m) == 0
constexpr float kExpMin = -87.f;  // exp below it is taken as 0 (see exp_le0)

struct Params {  // one row's: temperature (> 0 here), top-p, min-p, top-k, noise key
  float t, top_p, min_p;
  int64_t k;
  uint32_t key;
};
struct Row {  // a sampled row: logits c [V], block maxima, max c, max x (x = c / t, rounded)
  const float* c;
  const float* bmax;
  int64_t V;
  float cmax, m;
};
struct Cand {  // a candidate token: x = c / t, w = exp(x - m)
  float x, w;
  int32_t i;
};
struct Filters {  // sampling_filters.cpp's buffers (one per thread, reused)
  std::vector<float> w, xs;
  std::vector<int32_t> ids;
  std::vector<Cand> cand;
};

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// bits h >> 9 of uniform_noise[b, v] (key: row b's): u = (bits + 0.5) * 2^-23
inline uint32_t noise_bits(uint32_t key, uint32_t v) {
  return fmix32(key ^ fmix32((v * 0x9E3779B1u) ^ 0x68E31DA4u)) >> 9;
}

inline float uniform(uint32_t key, uint32_t v) {  // every step exact
  return (static_cast<float>(static_cast<int32_t>(noise_bits(key, v))) + 0.5f) * 0x1p-23f;
}

// exp(d) for d <= 0, and 0 below kExpMin (a weight < 1.7e-38 of the max's: never sampled, its
// mass nothing): glibc's vector expf takes a slow scalar path for arguments that underflow
inline float exp_le0(float d) {
  const float e = std::exp(std::max(d, kExpMin));
  return d > kExpMin ? e : 0.f;
}

// x[i] = c[i] / t as torch rounds it (IEEE division), >= kFloor; x may be c (sampling.cpp)
void divide(const float* c, int64_t n, float t, float* x);

// a row with top-k and / or top-p -> its token (sampling_filters.cpp)
int64_t filtered_row(Filters& s, const Row& r, const Params& p);

}  // namespace pipellm::sampling
