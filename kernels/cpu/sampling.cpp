// Batched token sampling on the CPU: kernels/sampling.py's sample_reference (the spec), one row
// per task on ATen's thread pool, without sorting the vocabulary.
//
// A row: chooser logits c -> float32 (-inf raised to kFloor: no infinity reaches the arithmetic,
// which is built with -ffinite-math-only), block maxima, max and first argmax (greedy rows end
// here). Sampled rows work on c and its block maxima (x = c / t is monotone in c) and compute
// x = c / t (IEEE division, as torch rounds) only for the tokens they look at:
//   - no top-k / top-p: the exponential race, argmax of p / E, over the blocks that may hold
//     the winner: log(p / E) <= (x - m) - log(E), with E = -log(u) >= 1 - u >= 2^floor(log2(1 -
//     u)) read off the float's exponent (integer ops: no log), against the best race value so
//     far (at first the argmax token's); blocks min-p drops whole are skipped too;
//   - else candidates c >= tau, tau widened until they provably hold the top-k set (count) or
//     the nucleus (mass, on the full-vocabulary normalizer); on those only: the k-th largest
//     value (nth_element), the nucleus (a heap popped until the mass ahead reaches top_p, summed
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
constexpr float kFloor = -1e30f;    // stands for -inf: exp(kFloor - m) == 0
constexpr float kExpMin = -87.f;    // exp below it is taken as 0 (see exp_le0)
constexpr float kLn2 = 0.6931472f;
constexpr double kMassSlack = 1e-5;  // relative margin of the nucleus' candidate mass
constexpr int64_t kMaxCand = 2048;   // candidate sets are narrowed to about this many

struct Params {
  float t, top_p, min_p;
  int64_t k;
  uint32_t key;
};
struct Row {  // a sampled row: logits c [V] (>= kFloor), block maxima, max c, max x = c / t
  const float* c;
  const float* bmax;
  int64_t V;
  float cmax, m;
};
struct Cand {
  float x, w;  // x = c / t, w = exp(x - m)
  int32_t i;
};
struct Scratch {  // one thread's buffers, reused across rows and calls
  std::vector<float> c, raw, bmax, braw, w, xs;
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

uint32_t row_key(int64_t seed, int64_t step) {  // sampling._row_keys
  const uint64_t s = static_cast<uint64_t>(seed), t = static_cast<uint64_t>(step);
  uint32_t k = fmix32(static_cast<uint32_t>(s) ^ 0x9E3779B9u);
  k = fmix32(k ^ static_cast<uint32_t>(s >> 32) ^ 0x7F4A7C15u);
  k = fmix32(k ^ static_cast<uint32_t>(t) ^ 0x85EBCA77u);
  return fmix32(k ^ static_cast<uint32_t>(t >> 32) ^ 0xC2B2AE3Du);
}

// bits h >> 9 of uniform_noise[b, v] (row key of b): u = (bits + 0.5) * 2^-23
inline uint32_t noise_bits(uint32_t key, uint32_t v) {
  return fmix32(key ^ fmix32((v * 0x9E3779B1u) ^ 0x68E31DA4u)) >> 9;
}

inline float uniform(uint32_t key, uint32_t v) {  // every step exact
  return (static_cast<float>(static_cast<int32_t>(noise_bits(key, v))) + 0.5f) * 0x1p-23f;
}

// a lower bound of log(E), E = -log(u) >= 1 - u = (2^23 - bits - 0.5) * 2^-23: the exponent
inline float log_e_floor(uint32_t key, uint32_t v) {
  const int32_t rest = static_cast<int32_t>((1u << 23) - noise_bits(key, v));  // >= 1
  const float one_minus_u = static_cast<float>(rest) - 0.5f;  // (1 - u) * 2^23, exact
  uint32_t b;
  std::memcpy(&b, &one_minus_u, sizeof b);
  return static_cast<float>(static_cast<int32_t>(b >> 23) - 127 - 23) * kLn2;
}

// exp(d) for d <= 0, and 0 below kExpMin (a weight < 1.7e-38 of the max's: never sampled, its
// mass nothing): glibc's vector expf takes a slow scalar path for arguments that underflow
inline float exp_le0(float d) {
  const float e = std::exp(std::max(d, kExpMin));
  return d > kExpMin ? e : 0.f;
}

// x[i] = c[i] / t as torch rounds it (IEEE division: compiled without -funsafe-math), >= kFloor
__attribute__((noinline, optimize("no-unsafe-math-optimizations")))
void divide(const float* c, int64_t n, float t, float* x) {
  for (int64_t i = 0; i < n; ++i) {
    const float q = c[i] / t;
    x[i] = q < kFloor ? kFloor : q;
  }
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

// ---- top-k / top-p: candidates, then exact cut-offs on them

// over the blocks of c (kBlock long but the last) that reach tau: f(first token, length)
template <typename F>
inline void blocks_above(const Row& r, float tau, const F& f) {
  for (int64_t j0 = 0; j0 < r.V; j0 += kBlock)
    if (r.bmax[j0 / kBlock] >= tau) f(j0, std::min(kBlock, r.V - j0));
}

int64_t count_above(const Row& r, float tau) {  // tokens with c >= tau
  int64_t count = 0;
  blocks_above(r, tau, [&](int64_t j0, int64_t n) {
    int32_t k = 0;
    if (n == kBlock) {
      for (int64_t j = 0; j < kBlock; ++j) k += r.c[j0 + j] >= tau;
    } else {
      for (int64_t j = 0; j < n; ++j) k += r.c[j0 + j] >= tau;
    }
    count += k;
  });
  return count;
}

float mass_above(const Row& r, const float* w, float tau) {  // their sum of w
  float mass = 0.f;
  blocks_above(r, tau, [&](int64_t j0, int64_t n) {
    float m = 0.f;
    if (n == kBlock) {
      for (int64_t j = 0; j < kBlock; ++j) m += r.c[j0 + j] >= tau ? w[j0 + j] : 0.f;
    } else {
      for (int64_t j = 0; j < n; ++j) m += r.c[j0 + j] >= tau ? w[j0 + j] : 0.f;
    }
    mass += m;
  });
  return mass;
}

// a tau with enough(tau): the largest cmax - t * 2^j (j >= 0) that has it, then, while more
// than `cap` tokens reach it, bisected towards the one before (kFloor: every token)
template <typename F>
float threshold(const Row& r, float t, int64_t cap, const F& enough) {
  float lo = kFloor, hi = r.cmax;
  for (float d = t; d < 1e6f * t && lo == kFloor; d *= 2.f) (enough(r.cmax - d) ? lo : hi) = r.cmax - d;
  for (int i = 0; i < 12 && lo != kFloor && count_above(r, lo) > cap; ++i) {
    const float mid = 0.5f * (lo + hi);
    (enough(mid) ? lo : hi) = mid;
  }
  return lo;
}

// w = exp(x - m) of every token (0 in the blocks wholly below exp's range); returns their sum
float normalizer(const Row& r, float t, float* w) {
  const float below = r.cmax + (kExpMin - 1.f) * t;
  float z = 0.f;
  for (int64_t j0 = 0; j0 < r.V; j0 += kBlock) {
    const int64_t n = std::min(kBlock, r.V - j0);
    float* wb = w + j0;
    if (r.bmax[j0 / kBlock] < below) {
      std::fill(wb, wb + n, 0.f);
      continue;
    }
    divide(r.c + j0, n, t, wb);
    float zb = 0.f;
    if (n == kBlock) {
      for (int64_t j = 0; j < kBlock; ++j) zb += (wb[j] = exp_le0(wb[j] - r.m));
    } else {
      for (int64_t j = 0; j < n; ++j) zb += (wb[j] = exp_le0(wb[j] - r.m));
    }
    z += zb;
  }
  return z;
}

// the tokens with c >= tau, lowered by more than c / t's rounding, so that no token whose x
// ties one of theirs is left out -> s.cand with exact x and w
void collect(const Row& r, float t, float tau, Scratch& s) {
  tau -= std::abs(tau) * 1e-6f;
  s.xs.clear(), s.ids.clear(), s.cand.clear();
  blocks_above(r, tau, [&](int64_t j0, int64_t n) {
    for (int64_t j = j0; j < j0 + n; ++j)
      if (r.c[j] >= tau) s.xs.push_back(r.c[j]), s.ids.push_back(static_cast<int32_t>(j));
  });
  const int64_t n = static_cast<int64_t>(s.xs.size());
  divide(s.xs.data(), n, t, s.xs.data());
  for (int64_t i = 0; i < n; ++i) s.cand.push_back({s.xs[i], exp_le0(s.xs[i] - r.m), s.ids[i]});
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

int64_t filtered_row(Scratch& s, const Row& r, const Params& p) {
  const bool top_k = p.k > 0 && p.k < r.V, top_p = p.top_p < 1.f;
  // tokens below `tail` weigh < e^-17 / V each, < 2^-24 of any normalizer (>= 1) together
  const float tail = r.cmax - p.t * (std::log(static_cast<float>(r.V)) + 17.f);
  float tau, z = -1.f;  // z < 0: the candidates' sum
  if (top_k) {
    tau = threshold(r, p.t, std::max<int64_t>(kMaxCand, 2 * p.k),
                    [&](float x) { return count_above(r, x) >= p.k; });
  } else if (count_above(r, tail) <= kMaxCand) {  // the candidates' sum is the normalizer
    tau = tail;
  } else {  // the nucleus needs the full-vocabulary normalizer
    const float* w = s.w.data();
    z = normalizer(r, p.t, s.w.data());
    const double need = static_cast<double>(p.top_p) * z * (1.0 + kMassSlack);
    tau = need >= z ? kFloor : threshold(r, p.t, kMaxCand, [&](float x) {
      return mass_above(r, w, x) >= need;
    });
  }
  collect(r, p.t, tau, s);
  if (top_k) z = keep_from(s.cand, kth_largest(s.cand, p.k));
  if (z < 0.f) z = keep_from(s.cand, kFloor);
  if (top_p) z = keep_from(s.cand, nucleus_floor(s.cand, z, p.top_p));
  return race_candidates(s.cand, z, p);
}

// ---- no top-k / top-p: the race over the blocks that may hold the winner

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
    tok = (p.k > 0 && p.k < V) || p.top_p < 1.f ? filtered_row(s, r, p) : race_row(r, tok, p);
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
    s.c.resize(V), s.raw.resize(V), s.w.resize(V);
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
