// Batched token sampling on the CPU: pipellm/kernels/sampling.py's sample_reference (the spec), one row
// per task on ATen's thread pool, without sorting the vocabulary.
//
// A row: chooser logits c -> float32, block maxima, max and first argmax (greedy rows end here).
// Sampled rows work on c and its block maxima (x = c / t is monotone in c) and compute x = c / t
// (IEEE division, as torch rounds) only for the tokens they look at. Rows with top-k or top-p:
// sampling_filters.cpp. The others: the exponential race, argmax of p / E, over the blocks that
// may hold the winner: log(p / E) <= (x - m) - log(E), with E = -log(u) >= 1 - u >=
// 2^floor(log2(1 - u)) read off the float's exponent (integer ops: no log), against the best
// race value so far (at first the argmax token's); blocks min-p drops whole are skipped too.
// exp/log are glibc's, not torch's, so a token can differ from the reference only where two race
// values, or a cumulative mass and top_p, are within float32 rounding.
#include <ATen/Parallel.h>
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"
#include "sampling.h"

namespace pipellm::sampling {

__attribute__((noinline, optimize("no-unsafe-math-optimizations")))
void divide(const float* c, int64_t n, float t, float* x) {  // no reciprocal: IEEE rounding
  for (int64_t i = 0; i < n; ++i) {
    const float q = c[i] / t;
    x[i] = q < kFloor ? kFloor : q;
  }
}

}  // namespace pipellm::sampling

namespace {

using namespace pipellm::sampling;

constexpr float kLn2 = 0.6931472f;

struct Scratch {  // one thread's buffers, reused across rows and calls
  std::vector<float> c, raw, bmax, braw;
  Filters filters;
};

uint32_t row_key(int64_t seed, int64_t step) {  // sampling._row_keys
  const uint64_t s = static_cast<uint64_t>(seed), t = static_cast<uint64_t>(step);
  uint32_t k = fmix32(static_cast<uint32_t>(s) ^ 0x9E3779B9u);
  k = fmix32(k ^ static_cast<uint32_t>(s >> 32) ^ 0x7F4A7C15u);
  k = fmix32(k ^ static_cast<uint32_t>(t) ^ 0x85EBCA77u);
  return fmix32(k ^ static_cast<uint32_t>(t >> 32) ^ 0xC2B2AE3Du);
}

// a lower bound of log(E), E = -log(u) >= 1 - u = (2^23 - bits - 0.5) * 2^-23: the exponent
inline float log_e_floor(uint32_t key, uint32_t v) {
  const int32_t rest = static_cast<int32_t>((1u << 23) - noise_bits(key, v));  // >= 1
  const float one_minus_u = static_cast<float>(rest) - 0.5f;  // (1 - u) * 2^23, exact
  uint32_t b;
  std::memcpy(&b, &one_minus_u, sizeof b);
  return static_cast<float>(static_cast<int32_t>(b >> 23) - 127 - 23) * kLn2;
}

// row b of t [B, V] (float32, bf16 or fp16, unit column stride) -> out [V] float32, >= kFloor
void load_row(const Tensor& t, int64_t b, float* out) {
  const int64_t V = t.size(1), off = b * t.stride(0);
  if (t.scalar_type() == at::kFloat) {
    const float* p = t.data_ptr<float>() + off;
    for (int64_t i = 0; i < V; ++i) out[i] = std::max(p[i], kFloor);
  } else if (t.scalar_type() == at::kBFloat16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()) + off;
    for (int64_t i = 0; i < V; ++i) {
      const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      out[i] = std::max(f, kFloor);
    }
  } else {
    const at::Half* p = t.data_ptr<at::Half>() + off;
    for (int64_t i = 0; i < V; ++i) out[i] = std::max(static_cast<float>(p[i]), kFloor);
  }
}

float value_at(const Tensor& t, int64_t b, int64_t i) {  // t[b, i] as float32, unclamped
  const int64_t off = b * t.stride(0) + i;
  if (t.scalar_type() == at::kFloat) return t.data_ptr<float>()[off];
  if (t.scalar_type() == at::kBFloat16) return static_cast<float>(t.data_ptr<at::BFloat16>()[off]);
  return static_cast<float>(t.data_ptr<at::Half>()[off]);
}

inline float block_max(const float* x, int64_t n) {  // n == kBlock: a fixed-length loop
  float bm = kFloor;
  if (n == kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) bm = std::max(bm, x[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) bm = std::max(bm, x[j]);
  }
  return bm;
}

// x [V] -> bmax [ceil(V / kBlock)] block maxima; returns the max and its first index
std::pair<float, int64_t> scan(const float* x, int64_t V, float* bmax) {
  float m = kFloor;
  for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
    bmax[j0 / kBlock] = block_max(x + j0, std::min(kBlock, V - j0));
    m = std::max(m, bmax[j0 / kBlock]);
  }
  int64_t j = 0;
  while (bmax[j / kBlock] < m) j += kBlock;
  while (x[j] < m) ++j;
  return {m, j};
}

float logsumexp(const float* x, int64_t V, float m) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < V; ++i) s += exp_le0(x[i] - m);
  return m + std::log(s);
}

// whether a token of block [j0, j0 + kBlock) may have log(w / E) >= lb: (c - cmax) / t
// approximates x - m (within slack), log_e_floor bounds log(E) from below
bool may_win(const float* c, int64_t j0, float cmax, float inv_t, uint32_t key, float lb) {
  float top = kFloor;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float v = (c[j0 + j] - cmax) * inv_t - log_e_floor(key, static_cast<uint32_t>(j0 + j));
    top = std::max(top, v);
  }
  return top >= lb;
}

// race values r [n] of tokens j0 + [0, n) (x [n]: their x): w / E, 0 where min-p drops them
// (w < w_min); a plain loop, so that GCC vectorizes it with glibc's vector exp and log
void race_block(const float* __restrict x, float* __restrict r, int64_t j0, int64_t n, float m,
                float w_min, uint32_t key) {
  for (int64_t j = 0; j < n; ++j) {
    const float w = exp_le0(x[j] - m);
    const float e = -std::log(uniform(key, static_cast<uint32_t>(j0 + j)));
    r[j] = (w >= w_min ? w : 0.f) / e;
  }
}

// p / E compared as w / E (w = exp(x - m): the common 1 / Z dropped); arg: an argmax of c
int64_t race_row(const Row& r, int64_t arg, const Params& p) {
  alignas(32) float x[kBlock], race[kBlock];
  const float inv_t = 1.f / p.t, slack = 1e-3f + 4e-6f * (std::abs(r.m) + 20.f);
  const float drop = p.min_p > 0.f ? std::log(p.min_p) - slack : kFloor;  // on x - m
  // log of the argmax token's race value 1 / E: below it no token wins
  float lb = -std::log(-std::log(uniform(p.key, static_cast<uint32_t>(arg))));
  float best = 0.f;
  int64_t best_i = arg;
  for (int64_t j0 = 0; j0 < r.V; j0 += kBlock) {
    const int64_t n = std::min(kBlock, r.V - j0);
    const float top = (r.bmax[j0 / kBlock] - r.cmax) * inv_t;  // the block's max x - m
    if (top < drop || top + 24.f * kLn2 < lb - slack) continue;  // log(E) >= -24 ln 2
    if (n == kBlock && !may_win(r.c, j0, r.cmax, inv_t, p.key, lb - slack)) continue;
    divide(r.c + j0, n, p.t, x);
    race_block(x, race, j0, n, r.m, p.min_p, p.key);
    const float rb = block_max(race, n);
    if (!(rb > best)) continue;
    int64_t j = 0;
    while (race[j] < rb) ++j;
    best = rb, best_i = j0 + j;
    lb = std::log(best);
  }
  return best_i;
}

// one row -> (token id, logprob)
std::pair<int64_t, float> sample_one(Scratch& s, const Tensor& logits,
                                     const std::optional<Tensor>& raw, int64_t b,
                                     const Params& p, bool need_logprobs) {
  const int64_t V = logits.size(1);
  float* c = s.c.data();
  load_row(logits, b, c);
  auto [cmax, tok] = scan(c, V, s.bmax.data());
  float lse = 0.f;
  if (need_logprobs && raw) {
    load_row(*raw, b, s.raw.data());
    lse = logsumexp(s.raw.data(), V, scan(s.raw.data(), V, s.braw.data()).first);
  } else if (need_logprobs) {
    lse = logsumexp(c, V, cmax);
  }
  if (p.t > 0.f) {
    const Row r{c, s.bmax.data(), V, cmax, std::max(pipellm::ieee_div(cmax, p.t), kFloor)};
    tok = (p.k > 0 && p.k < V) || p.top_p < 1.f ? filtered_row(s.filters, r, p)
                                                 : race_row(r, tok, p);
  }
  const float lp = need_logprobs ? value_at(raw ? *raw : logits, b, tok) - lse : 0.f;
  return {tok, lp};
}

Tensor rows_of(const Tensor& t, int64_t B, int64_t V) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == B && t.size(1) == V && t.device().is_cpu(),
              "logits must be CPU [B, V]");
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "logits must be float32, bfloat16 or float16");
  return t.stride(1) == 1 ? t : t.contiguous();
}

}  // namespace

std::tuple<Tensor, Tensor> sample_rows(Tensor logits, std::optional<Tensor> raw_logits,
                                       Tensor temperature, Tensor top_p, Tensor min_p,
                                       Tensor top_k, Tensor seeds, Tensor steps,
                                       bool need_logprobs) {
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "vocabulary size out of range");
  logits = rows_of(logits, B, V);
  if (raw_logits) raw_logits = rows_of(*raw_logits, B, V);
  const auto f32 = [](const Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const auto i64 = [](const Tensor& t) { return t.to(at::kLong).contiguous(); };
  const Tensor temp = f32(temperature), tp = f32(top_p), mp = f32(min_p), tk = i64(top_k),
               sd = i64(seeds), st = i64(steps);
  for (const Tensor& t : {temp, tp, mp, tk, sd, st}) TORCH_CHECK(t.numel() == B, "[B] params");
  auto ids = at::empty({B}, at::kLong);
  auto lps = at::empty({B}, at::kFloat);
  int64_t* out_ids = ids.data_ptr<int64_t>();
  float* out_lps = lps.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch s;
    s.c.resize(V), s.raw.resize(V), s.filters.w.resize(V);
    s.bmax.resize((V + kBlock - 1) / kBlock), s.braw.resize((V + kBlock - 1) / kBlock);
    for (int64_t b = begin; b < end; ++b) {
      const Params p{temp.data_ptr<float>()[b], tp.data_ptr<float>()[b],
                     mp.data_ptr<float>()[b], tk.data_ptr<int64_t>()[b],
                     row_key(sd.data_ptr<int64_t>()[b], st.data_ptr<int64_t>()[b])};
      std::tie(out_ids[b], out_lps[b]) = sample_one(s, logits, raw_logits, b, p, need_logprobs);
    }
  });
  return {ids, lps};
}
