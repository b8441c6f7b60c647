// Top-k and top-p for the token sampler (sampling.cpp), without sorting the vocabulary:
// candidates c >= tau, tau widened until they provably hold the top-k set (count) or the nucleus
// (mass, on the full-vocabulary normalizer, or on the candidates' own sum where the tokens below
// tau weigh less than float32 rounding), then narrowed by bisection to about kMaxCand; on those
// only, with exact x = c / t: the k-th largest value (nth_element), the nucleus (a heap popped
// until the mass ahead reaches top_p, summed as torch's cumsum: float32 terms, a double
// accumulator), min-p, and the race. Cut-offs compare values: ties there are kept.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "sampling.h"

namespace pipellm::sampling {
namespace {

constexpr double kMassSlack = 1e-5;  // relative margin of the nucleus' candidate mass
constexpr int64_t kMaxCand = 2048;   // candidate sets are narrowed to about this many

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
  for (float d = t; d < 1e6f * t && lo == kFloor; d *= 2.f)
    (enough(r.cmax - d) ? lo : hi) = r.cmax - d;
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
void collect(const Row& r, float t, float tau, Filters& s) {
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

float kth_largest(std::vector<Cand>& c, int64_t k) {  // c holds >= k, but with NaN logits
  if (c.empty()) return kFloor;
  k = std::min<int64_t>(k, static_cast<int64_t>(c.size()));
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

}  // namespace

int64_t filtered_row(Filters& s, const Row& r, const Params& p) {
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

}  // namespace pipellm::sampling
