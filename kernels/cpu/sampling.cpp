// Batched token sampling on the CPU: kernels/sampling.py's sample_reference (the spec), one row
// per task on ATen's thread pool, without sorting the vocabulary.
//
// A row: chooser logits -> float32 (-inf raised to kFloor: no infinity reaches the arithmetic,
// which is built with -ffinite-math-only), block maxima, max and first argmax (greedy rows end
// here); x = logits / temperature (IEEE division, as torch rounds); then
//   - no top-k / top-p: the exponential race over blocks that can hold the winner: a token with
//     p_i / E_min below the best race value so far cannot win (E = -log(u) >= E_min), nor one
//     min-p drops; the bound starts from the argmax token's race value;
//   - else candidates x >= tau, tau widened until they provably hold the top-k set (count) or
//     the nucleus (mass, on the full-vocabulary normalizer); on those only: the k-th largest
//     value (nth_element), the nucleus (a heap popped until the mass ahead reaches top_p, sums
//     as torch's cumsum: float terms, double accumulator), min-p, and the race.
// Cut-offs compare values, so ties there are kept. The noise u is `uniform_noise`'s, bit for bit
// (uint32 murmur3 fmix32); exp/log are glibc's, not torch's, so a token can differ from the
// reference only where two race values, or a cumulative mass and top_p, are within rounding.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace {

using torch::Tensor;

constexpr int64_t kBlock = 64;
constexpr float kFloor = -1e30f;   // stands for -inf: exp(kFloor - m) == 0
constexpr float kLogEMin = -16.7f;  // <= log(-log(1 - 2^-24)) = -16.636: log of the least E
constexpr float kSlack = 1e-3f;     // log-space margin of the skip bounds (exp/log rounding)
constexpr double kMassSlack = 1e-5;  // relative margin of the nucleus' candidate mass

struct Params {
  float t, top_p, min_p;
  int64_t k;
  uint32_t key;
};
struct Cand {
  float x, w;  // x = logit / temperature, w = exp(x - max)
  int32_t i;
};
struct Scratch {  // one thread's buffers, reused across rows and calls
  std::vector<float> x, raw, bmax, w, r;
  std::vector<Cand> c;
};

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

uint32_t row_key(int64_t seed, int64_t step) {  // sampling._row_keys
  const uint64_t s = static_cast<uint64_t>(seed), t = static_cast<uint64_t>(step);
  uint32_t k = fmix32(static_cast<uint32_t>(s) ^ 0x9E3779B9u);
  k = fmix32(k ^ static_cast<uint32_t>(s >> 32) ^ 0x7F4A7C15u);
  k = fmix32(k ^ static_cast<uint32_t>(t) ^ 0x85EBCA77u);
  return fmix32(k ^ static_cast<uint32_t>(t >> 32) ^ 0xC2B2AE3Du);
}

// uniform_noise[b, v] for the row key of b: ((h >> 9) + 0.5) * 2^-23, every step exact
inline float uniform(uint32_t key, uint32_t v) {
  const uint32_t h = fmix32(key ^ fmix32((v * 0x9E3779B1u) ^ 0x68E31DA4u));
  return (static_cast<float>(static_cast<int32_t>(h >> 9)) + 0.5f) * 0x1p-23f;
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

// x [V] -> bmax [ceil(V / kBlock)] block maxima; returns the max and its first index
std::pair<float, int64_t> scan(const float* x, int64_t V, float* bmax) {
  float m = kFloor;
  for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
    const int64_t n = std::min(kBlock, V - j0);
    float bm = kFloor;
#pragma omp simd reduction(max : bm)
    for (int64_t j = 0; j < n; ++j) bm = std::max(bm, x[j0 + j]);
    bmax[j0 / kBlock] = bm;
    m = std::max(m, bm);
  }
  int64_t j0 = 0;
  while (bmax[j0 / kBlock] < m) j0 += kBlock;
  while (x[j0] < m) ++j0;
  return {m, j0};
}

float logsumexp(const float* x, int64_t V, float m) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < V; ++i) s += std::exp(x[i] - m);
  return m + std::log(s);
}

int64_t count_above(const float* x, const float* bmax, int64_t V, float tau) {
  int64_t count = 0;
  for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
    if (bmax[j0 / kBlock] < tau) continue;  // blocks below tau hold none
    const int64_t j1 = std::min(j0 + kBlock, V);
#pragma omp simd reduction(+ : count)
    for (int64_t j = j0; j < j1; ++j) count += x[j] >= tau;
  }
  return count;
}

float mass_above(const float* x, const float* w, const float* bmax, int64_t V, float tau) {
  float mass = 0.f;
  for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
    if (bmax[j0 / kBlock] < tau) continue;
    const int64_t j1 = std::min(j0 + kBlock, V);
#pragma omp simd reduction(+ : mass)
    for (int64_t j = j0; j < j1; ++j) mass += x[j] >= tau ? w[j] : 0.f;
  }
  return mass;
}

// the largest tau = m - 2^j (j >= 0) whose tokens x >= tau number >= k (k > 0), or else hold
// mass >= need (w: exp(x - m)); kFloor (every token) when none does
float widen(const float* x, const float* w, const float* bmax, int64_t V, float m, int64_t k,
            double need) {
  for (float d = 1.f; d < 1e6f; d *= 2.f) {
    const float tau = m - d;
    if (k > 0 ? count_above(x, bmax, V, tau) >= k : mass_above(x, w, bmax, V, tau) >= need)
      return tau;
  }
  return kFloor;
}

void collect(const float* x, const float* bmax, int64_t V, float m, float tau,
             std::vector<Cand>& c) {
  c.clear();
  for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
    if (bmax[j0 / kBlock] < tau) continue;
    for (int64_t j = j0; j < std::min(j0 + kBlock, V); ++j)
      if (x[j] >= tau) c.push_back({x[j], 0.f, static_cast<int32_t>(j)});
  }
  for (Cand& e : c) e.w = std::exp(e.x - m);
}

// keep the candidates with x >= thr; returns their sum of w (the softmax normalizer)
float keep_from(std::vector<Cand>& c, float thr) {
  c.erase(std::remove_if(c.begin(), c.end(), [thr](const Cand& e) { return e.x < thr; }),
          c.end());
  float z = 0.f;
  for (const Cand& e : c) z += e.w;
  return z;
}

float kth_largest(std::vector<Cand>& c, int64_t k) {
  auto desc = [](const Cand& a, const Cand& b) { return a.x > b.x; };
  std::nth_element(c.begin(), c.begin() + (k - 1), c.end(), desc);
  return c[k - 1].x;
}

// the value of the last rank the reference keeps: ranks in descending order while the mass
// strictly ahead of them (float32 of a double sum of float32 probabilities) is < top_p
float nucleus_floor(std::vector<Cand>& c, float z, float top_p) {
  auto less = [](const Cand& a, const Cand& b) { return a.x < b.x; };
  std::make_heap(c.begin(), c.end(), less);
  const float inv_z = 1.f / z;
  double ahead = 0.0;
  float last = kFloor;
  for (auto end = c.end(); end != c.begin() && static_cast<float>(ahead) < top_p; --end) {
    std::pop_heap(c.begin(), end, less);
    last = (end - 1)->x;
    ahead += static_cast<double>((end - 1)->w * inv_z);
  }
  return last;
}

// the race over the candidates (normalizer z): first argmax of p / E where p >= min_p * max p
int64_t race_candidates(const std::vector<Cand>& c, float z, const Params& p) {
  const float inv_z = 1.f / z, p_min = p.min_p * inv_z;  // max p = exp(0) / z
  float best = -1.f;
  int64_t best_i = 0;
  for (const Cand& e : c) {
    const float prob = e.w * inv_z;
    if (prob < p_min) continue;
    const float r = prob / -std::log(uniform(p.key, static_cast<uint32_t>(e.i)));
    if (r > best || (r == best && e.i < best_i)) best = r, best_i = e.i;
  }
  return best_i;
}

int64_t filtered_row(Scratch& s, int64_t V, float m, const Params& p) {
  const float* x = s.x.data();
  const bool top_k = p.k > 0 && p.k < V, top_p = p.top_p < 1.f;
  float tau, z = 0.f;
  if (top_k) {
    tau = widen(x, nullptr, s.bmax.data(), V, m, p.k, 0.0);
  } else {  // the nucleus needs the full-vocabulary normalizer
    float* w = s.w.data();
#pragma omp simd reduction(+ : z)
    for (int64_t i = 0; i < V; ++i) z += (w[i] = std::exp(x[i] - m));
    const double need = static_cast<double>(p.top_p) * z * (1.0 + kMassSlack);
    tau = need >= z ? kFloor : widen(x, w, s.bmax.data(), V, m, 0, need);
  }
  collect(x, s.bmax.data(), V, m, tau, s.c);
  if (top_k) z = keep_from(s.c, kth_largest(s.c, p.k));
  if (top_p) z = keep_from(s.c, nucleus_floor(s.c, z, p.top_p));
  return race_candidates(s.c, z, p);
}

// race values r [n] of tokens j0 + [0, n): w / E, 0 where min-p drops (w < w_min); a plain
// loop, so that GCC vectorizes it with glibc's vector exp and log
void race_block(const float* __restrict x, float* __restrict r, int64_t j0, int64_t n, float m,
                float w_min, uint32_t key) {
  for (int64_t j = 0; j < n; ++j) {
    const float w = std::exp(x[j0 + j] - m);
    const float e = -std::log(uniform(key, static_cast<uint32_t>(j0 + j)));
    r[j] = (w >= w_min ? w : 0.f) / e;
  }
}

// the race without filters: blocks whose max cannot reach the bound are skipped, the others
// raced whole; p / E compared as w / E (w = exp(x - m): the common 1 / Z dropped)
int64_t race_row(Scratch& s, int64_t V, float m, int64_t arg, const Params& p) {
  float* r = s.r.data();
  const float drop = p.min_p > 0.f ? m + std::log(p.min_p) - kSlack : kFloor;
  // no token with x < bound beats the argmax's race value 1 / E_arg: w / E <= w / E_min
  float bound = m - std::log(-std::log(uniform(p.key, static_cast<uint32_t>(arg)))) + kLogEMin;
  float best = 0.f;
  int64_t best_i = arg;
  for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
    if (s.bmax[j0 / kBlock] < std::max(bound - kSlack, drop)) continue;
    const int64_t n = std::min(kBlock, V - j0);
    race_block(s.x.data(), r, j0, n, m, p.min_p, p.key);
    float rb = 0.f;
#pragma omp simd reduction(max : rb)
    for (int64_t j = 0; j < n; ++j) rb = std::max(rb, r[j]);
    if (!(rb > best)) continue;
    int64_t j = 0;
    while (r[j] < rb) ++j;
    best = rb, best_i = j0 + j;
    bound = m + std::log(best) + kLogEMin;
  }
  return best_i;
}

// one row -> (token id, logprob)
std::pair<int64_t, float> sample_one(Scratch& s, const Tensor& logits,
                                     const std::optional<Tensor>& raw, int64_t b,
                                     const Params& p, bool need_logprobs) {
  const int64_t V = logits.size(1);
  float* x = s.x.data();
  load_row(logits, b, x);
  auto [cmax, tok] = scan(x, V, s.bmax.data());
  float lse = 0.f;
  if (need_logprobs && raw) {
    load_row(*raw, b, s.raw.data());
    lse = logsumexp(s.raw.data(), V, scan(s.raw.data(), V, s.bmax.data()).first);
  } else if (need_logprobs) {
    lse = logsumexp(x, V, cmax);
  }
  if (p.t > 0.f) {
    pipellm::ieee_div_groups(x, V, &p.t, V);  // x = logits / temperature
    for (int64_t i = 0; i < V; ++i) x[i] = std::max(x[i], kFloor);
    const auto [m, arg] = scan(x, V, s.bmax.data());
    tok = (p.k > 0 && p.k < V) || p.top_p < 1.f ? filtered_row(s, V, m, p)
                                                 : race_row(s, V, m, arg, p);
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
  auto ids = torch::empty({B}, torch::kLong);
  auto lps = torch::empty({B}, torch::kFloat);
  int64_t* out_ids = ids.data_ptr<int64_t>();
  float* out_lps = lps.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch s;
    s.x.resize(V), s.raw.resize(V), s.w.resize(V), s.r.resize(kBlock);
    s.bmax.resize((V + kBlock - 1) / kBlock);
    for (int64_t b = begin; b < end; ++b) {
      const Params p{temp.data_ptr<float>()[b], tp.data_ptr<float>()[b],
                     mp.data_ptr<float>()[b], tk.data_ptr<int64_t>()[b],
                     row_key(sd.data_ptr<int64_t>()[b], st.data_ptr<int64_t>()[b])};
      std::tie(out_ids[b], out_lps[b]) = sample_one(s, logits, raw_logits, b, p, need_logprobs);
    }
  });
  return {ids, lps};
}
