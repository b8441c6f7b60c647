// The vectorized decode attention, a template over an ISA's float vector traits `V` (kLanes
// floats: load from float / bf16 / fp16, fmadd, horizontal sum, exp), included by each
// decode_attention_<isa>.cpp inside its target region. Same contract as decode_attention.cpp.
//
// Per sequence, or per part of it (a run of its rows, or some of its kv heads) where the batch
// has fewer sequences than threads (one work item, decode_attention_schedule.h; its rows are
// contiguous in the cache):
// the scores walk its K rows in order, 8 rows at a time, every query head's 8 dot products
// summed horizontally together (sum8); the softmax runs on vectors; then for each kv head, up
// to 4 of its query heads at once sum its V rows, a chunk of columns at a time with their
// accumulators in registers, each V row read once per 4 heads. A context part leaves its
// unnormalized sums with its max score and sum of exponentials, which `merge` weighs
// together. Rows are prefetched kAhead rows ahead. Math in float32. T is q's and out's
// element, KV the caches' (T, or fp16 under float32 queries). A head is NC vectors: a
// template constant for the powers of 2 (every loop unrolled), or 0 for any other multiple of
// kLanes, read from Args at run time.
#pragma once

namespace {

using pipellm::attention::Args;
using pipellm::attention::DType;

constexpr int64_t kAhead = 16;  // rows prefetched ahead of the one being read

// The cache lines of `bytes` bytes from p into the cache (a row read kAhead rows from now).
// Always inlined: GCC takes a function of prefetches alone for one without effects, and drops
// the calls it does not inline.
__attribute__((always_inline)) inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(p) + i);
}

// The vectors of a head: NC, or (NC = 0) head_dim / kLanes
template <class V, int NC>
inline int vectors(const Args& a) {
  return NC ? NC : static_cast<int>(a.D / V::kLanes);
}

// sum_c x[c] * y[c] over nc vectors
template <class V, typename KV>
inline float dot(const float* q, const KV* k, int nc) {
  typename V::F acc = V::mul(V::loadf(q), V::load(k));
  for (int c = 1; c < nc; ++c) acc = V::fmadd(V::loadf(q + c * V::kLanes), V::load(k + c * V::kLanes), acc);
  return V::sum(acc);
}

// s[i] = exp(s[i] - mx) for i < n; returns their sum
template <class V>
inline float exp_sum(float* s, int64_t n, float mx) {
  typename V::F acc = V::fzero(), m = V::set1(mx);
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    const typename V::F e = V::exp(V::sub(V::loadf(s + i), m));
    V::store(s + i, e);
    acc = V::add(acc, e);
  }
  float sum = V::sum(acc);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - mx));
  return sum;
}

// The vectors of a V row that G heads sum at once: the most (a power of 2, at most NC; 8 where
// NC is 0) that keeps their G * chunk accumulators within 12 registers
template <int NC, int G>
constexpr int chunk() {
  int c = NC ? NC : 8;
  while (c > 1 && G * c > 12) c /= 2;
  return c;
}

// out[h0 + j] = inv[h0 + j] * sum_t p[h0 + j][t] * V[t] for j < G, in the C vectors of columns
// from vector c0 on: heads h0.. of one kv head (vh: its V rows), the G * C accumulators in
// registers, so that each V row is read once for the G heads whatever the head size
template <class V, int C, int G, typename T, typename KV>
void weigh_cols(const Args& a, const float* p, int64_t n, const float* inv, const KV* vh,
                int64_t h0, int c0, T* out) {
  typename V::F acc[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = V::fzero();
  for (int64_t t = 0; t < n; ++t) {
    const KV* row = vh + t * a.row_stride + c0 * V::kLanes;
    if (t + kAhead < n) prefetch(row + kAhead * a.row_stride, C * V::kLanes * sizeof(KV));
    typename V::F pt[G];
    for (int j = 0; j < G; ++j) pt[j] = V::set1(p[(h0 + j) * n + t]);
    for (int c = 0; c < C; ++c) {
      const typename V::F x = V::load(row + c * V::kLanes);
      for (int j = 0; j < G; ++j) acc[j][c] = V::fmadd(pt[j], x, acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j) {
    float o[C * V::kLanes];
    const typename V::F scale = V::set1(inv[h0 + j]);
    for (int c = 0; c < C; ++c) V::store(o + c * V::kLanes, V::mul(acc[j][c], scale));
    T* oh = out + (h0 + j) * a.D + c0 * V::kLanes;
    for (int64_t d = 0; d < C * V::kLanes; ++d) oh[d] = static_cast<T>(o[d]);
  }
}

// weigh_cols over the columns from vector c0 to nc: chunks of C, the rest in halves of it
template <class V, int C, int G, typename T, typename KV>
void weigh_from(const Args& a, const float* p, int64_t n, const float* inv, const KV* vh,
                int64_t h0, int c0, int nc, T* out) {
  for (; c0 + C <= nc; c0 += C) weigh_cols<V, C, G>(a, p, n, inv, vh, h0, c0, out);
  if constexpr (C > 1) weigh_from<V, C / 2, G>(a, p, n, inv, vh, h0, c0, nc, out);
}

// weigh_cols over every column of heads h0.. (G of them, one kv head)
template <class V, int NC, int G, typename T, typename KV>
void weigh_v(const Args& a, const float* p, int64_t n, const float* inv, const KV* v, int64_t h0,
             T* out) {
  const KV* vh = v + (h0 / (a.H / a.Hkv)) * a.D;
  weigh_from<V, chunk<NC, G>(), G>(a, p, n, inv, vh, h0, 0, vectors<V, NC>(a), out);
}

struct Scratch {  // one thread's buffers
  std::vector<float> qf, scores, inv;
};

// The query heads [h0, h1) (whole kv heads) of one sequence over its n rows from k, v: into
// out, normalized (O = T); or for a context part (m, l not null; O = float), per query head
// sum_t exp(s_t - m) V[t] into out [H, D], the max score into m and sum_t exp(s_t - m) into l.
template <class V, int NC, typename T, typename KV, typename O>
void attend(const Args& a, const T* q, const KV* k, const KV* v, int64_t n, int64_t h0,
            int64_t h1, O* out, Scratch& s, float* m = nullptr, float* l = nullptr) {
  std::vector<float>& qf = s.qf;
  std::vector<float>& scores = s.scores;
  std::vector<float>& inv = s.inv;
  const int nc = vectors<V, NC>(a);
  const int64_t D = nc * V::kLanes;
  const int64_t H = a.H, group = a.H / a.Hkv, rs = a.row_stride;
  const int64_t kv0 = h0 / group, kv_bytes = (h1 - h0) / group * D * sizeof(KV);
  qf.resize(H * D);
  scores.resize(H * n);
  inv.resize(H);
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t d = 0; d < D; ++d)
      qf[h * D + d] = static_cast<float>(q[h * a.q_sh + d]) * a.scale;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {  // scores, 8 rows at a time: their 8 dots summed together
    for (int64_t i = kAhead; i < kAhead + 8 && t + i < n; ++i)
      prefetch(k + (t + i) * rs + kv0 * D, kv_bytes);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = qf.data() + h * D;
      const KV* kh = k + t * rs + (h / group) * D;
      typename V::F acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = V::mul(V::loadf(qh), V::load(kh + i * rs));
      for (int c = 1; c < nc; ++c) {
        const typename V::F qc = V::loadf(qh + c * V::kLanes);
        for (int i = 0; i < 8; ++i) acc[i] = V::fmadd(qc, V::load(kh + i * rs + c * V::kLanes), acc[i]);
      }
      V::sum8(acc, scores.data() + h * n + t);
    }
  }
  for (; t < n; ++t)
    for (int64_t h = h0; h < h1; ++h)
      scores[h * n + t] = dot<V>(qf.data() + h * D, k + t * rs + (h / group) * D, nc);
  if (a.softcap > 0.f)
    for (int64_t i = h0 * n; i < h1 * n; ++i)
      scores[i] = a.softcap * std::tanh(scores[i] / a.softcap);
  for (int64_t h = h0; h < h1; ++h) {  // softmax: p = exp(s - max) / sum, the 1 / sum kept
    float* p = scores.data() + h * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p[i]);
    const float sum = exp_sum<V>(p, n, mx);
    inv[h] = m ? 1.f : 1.f / sum;
    if (m) m[h] = mx, l[h] = sum;
  }
  for (int64_t h = h0; h < h1;) {  // p . V: up to 4 heads of one kv head together
    const int64_t g = std::min(group - h % group, int64_t{4});
    switch (g) {
      case 4: weigh_v<V, NC, 4>(a, scores.data(), n, inv.data(), v, h, out); break;
      case 3: weigh_v<V, NC, 3>(a, scores.data(), n, inv.data(), v, h, out); break;
      case 2: weigh_v<V, NC, 2>(a, scores.data(), n, inv.data(), v, h, out); break;
      default: weigh_v<V, NC, 1>(a, scores.data(), n, inv.data(), v, h, out);
    }
    h += g;
  }
}

// out[b] of every sequence b cut into context parts: its parts' sums weighed by exp(m_p - M)
// (M: their largest max), over the same weighing of their sums of exponentials.
template <typename T>
void merge(const Args& a, int64_t split, const std::vector<float>& part_out,
           const std::vector<float>& part_m, const std::vector<float>& part_l, T* out) {
  const int64_t H = a.H, D = a.D;
  std::vector<float> w(split), acc(D);
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t cp = pipellm::attention::context_parts(
        pipellm::attention::rows_read(a.lens, b, a.window), split);
    if (cp == 1) continue;
    for (int64_t h = 0; h < H; ++h) {
      const auto at = [&](int64_t p) { return (b * split + p) * H + h; };
      float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t p = 0; p < cp; ++p) mx = std::max(mx, part_m[at(p)]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < cp; ++p) {
        w[p] = std::exp(part_m[at(p)] - mx);
        total += w[p] * part_l[at(p)];
        const float* po = part_out.data() + at(p) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += w[p] * po[d];
      }
      T* oh = out + (b * H + h) * D;
      for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<T>(acc[d] / total);
    }
  }
}

template <class V, int NC, typename T, typename KV = T>
void run_typed(const Args& a) {
  const T* qp = static_cast<const T*>(a.q);
  const KV* kp = static_cast<const KV*>(a.k);
  const KV* vp = static_cast<const KV*>(a.v);
  T* op = static_cast<T*>(a.out);
  const int64_t H = a.H, D = a.D, group = a.H / a.Hkv;
  const int64_t split = pipellm::attention::context_split(a.B);
  // the context parts' results, [B, split, H, D] and [B, split, H] (where a sequence is cut)
  std::vector<float> part_out, part_m, part_l;
  if (split > 1) {
    part_out.resize(a.B * split * H * D);
    part_m.resize(a.B * split * H);
    part_l.resize(a.B * split * H);
  }
  pipellm::attention::for_each_part<Scratch>(
      a.lens, a.B, a.window, a.Hkv, split, [&](const pipellm::attention::Part& p, Scratch& s) {
        const int64_t n = pipellm::attention::rows_read(a.lens, p.b, a.window);
        const int64_t first = a.starts[p.b] + a.lens[p.b] - n + p.r0;
        const T* q = qp + p.b * a.q_sb;
        const KV *k = kp + first * a.row_stride, *v = vp + first * a.row_stride;
        const int64_t h0 = p.kv0 * group, h1 = p.kv1 * group, rows = p.r1 - p.r0;
        if (pipellm::attention::context_parts(n, split) == 1) {
          attend<V, NC>(a, q, k, v, rows, h0, h1, op + p.b * H * D, s);
        } else {
          const int64_t at = (p.b * split + p.part) * H;
          attend<V, NC>(a, q, k, v, rows, h0, h1, part_out.data() + at * D, s,
                        part_m.data() + at, part_l.data() + at);
        }
      });
  if (split > 1) merge(a, split, part_out, part_m, part_l, op);
}

template <class V, int NC>
void run_nc(const Args& a) {
  switch (a.dtype) {
    case DType::kFloat:
      return a.cache == DType::kHalf ? run_typed<V, NC, float, c10::Half>(a)
                                     : run_typed<V, NC, float>(a);
    case DType::kBFloat16: return run_typed<V, NC, c10::BFloat16>(a);
    case DType::kHalf: return run_typed<V, NC, c10::Half>(a);
  }
}

// head_dim a multiple of kLanes up to kMaxHeadDim (decode_attention.h)
template <class V>
void run_isa(const Args& a) {
  if (a.D % V::kLanes || a.D > pipellm::attention::kMaxHeadDim)
    throw std::invalid_argument("decode attention: head_dim not a supported multiple");
  switch (a.D / V::kLanes) {
    case 1: return run_nc<V, 1>(a);
    case 2: return run_nc<V, 2>(a);
    case 4: return run_nc<V, 4>(a);
    case 8: return run_nc<V, 8>(a);
    case 16: return run_nc<V, 16>(a);
    case 32: return run_nc<V, 32>(a);
    default: return run_nc<V, 0>(a);
  }
}

}  // namespace
