// Prefill attention in float32 vectors: one template over an instruction set's float traits `V`
// (simd_avx2.h, simd_avx512.h) and the queries' type T (float, bf16, half; the caches' too, or
// INT8 with fp16 scales, or e4m3: dequantized as they are packed), included by each
// prefill_attention_<isa>.cpp inside its target region. Per sequence and KV head, K is packed
// once transposed into blocks of L = V::kLanes keys ([n_pad / L][D][L] floats, zeros past the
// last key) and V into [n][D] floats; then per (sequence, head, block of kRows queries), taken
// longest first from a shared counter (prefill_attention_schedule.h):
//   S = (scale Q) K^T over the keys the block sees, kR rows x kC vectors of keys at a time,
//   each row's exact softmax in float32 over its causal keys (with a window: the last `window`
//   of them; zeros elsewhere),
//   O = P V, kR rows x up to kC vectors of head dims at a time, divided by the row's sum.
// Not an online softmax: a block's scores for every key it sees are held at once (kRows rows of
// floats per thread), which a prompt's keys fit in.
#pragma once

namespace {

using pipellm::prefill::Args;

template <class V, typename T>
struct VecAttention {
  using F = typename V::F;
  static constexpr int L = V::kLanes;
  static constexpr int64_t kRows = 16;        // queries of a block
  // a micro-kernel: kR rows x kC vectors of accumulators, in the ISA's registers (32 / 16)
  static constexpr int kR = 4, kC = L == 16 ? 4 : 3;
  static constexpr int64_t kKeys = kC * L;    // keys a score pass covers
  static constexpr float kMasked = -1e30f;    // a hidden key's score (finite: -ffast-math)

  const Args& a;

  static int64_t padded(int64_t n) { return (n + kKeys - 1) / kKeys * kKeys; }

  // a cache row of C elements as floats (INT8: times `scales`, the row's fp16 scales; else null)
  template <typename C>
  static void row_of(const C* x, const c10::Half* scales, int64_t D, float* out) {
    using pipellm::prefill::kKvGroup;
    for (int64_t d = 0; d < D; ++d)
      out[d] = static_cast<float>(x[d]) * (scales ? static_cast<float>(scales[d / kKvGroup]) : 1.f);
  }

  // sequence s's KV head g from caches of C elements: kt [padded(n) / L][D][L] (K transposed
  // per block of L keys), vp [n][D], as floats
  template <typename C>
  void pack(int64_t s, int64_t g, float* kt, float* vp) const {
    const int64_t n = a.lens[s], D = a.D, row0 = a.starts[s];
    const C* k = static_cast<const C*>(a.k) + row0 * a.k_ts + g * a.k_hs;
    const C* v = static_cast<const C*>(a.v) + row0 * a.v_ts + g * a.v_hs;
    auto scales = [&](const void* p, int64_t ts, int64_t hs, int64_t j) {
      return p ? static_cast<const c10::Half*>(p) + (row0 + j) * ts + g * hs : nullptr;
    };
    std::vector<float> row(D);
    for (int64_t j = 0; j < padded(n); ++j) {
      float* dst = kt + (j / L) * D * L + j % L;
      if (j < n) row_of(k + j * a.k_ts, scales(a.k_scale, a.ks_ts, a.ks_hs, j), D, row.data());
      for (int64_t d = 0; d < D; ++d) dst[d * L] = j < n ? row[d] : 0.f;
    }
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (std::is_same_v<C, T>) {
        for (int64_t d = 0; d < D; d += L) V::store(vp + j * D + d, V::load(v + j * a.v_ts + d));
      } else {
        row_of(v + j * a.v_ts, scales(a.v_scale, a.vs_ts, a.vs_hs, j), D, vp + j * D);
      }
    }
  }

  // s[r][k0 .. k0 + kKeys) = qb[r] . key, rows r0 .. r0 + kR
  void score_tile(const float* qb, const float* kt, int64_t r0, int64_t k0, float* s,
                  int64_t width) const {
    const int64_t D = a.D;
    F acc[kR][kC];
    for (auto& row : acc)
      for (F& x : row) x = V::fzero();
    const float* kb = kt + (k0 / L) * D * L;
    for (int64_t d = 0; d < D; ++d) {
      F kv[kC];
      for (int c = 0; c < kC; ++c) kv[c] = V::loadf(kb + (c * D + d) * L);
      for (int r = 0; r < kR; ++r) {
        const F qv = V::set1(qb[(r0 + r) * D + d]);
        for (int c = 0; c < kC; ++c) acc[r][c] = V::fmadd(qv, kv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < kC; ++c) V::store(s + (r0 + r) * width + k0 + c * L, acc[r][c]);
  }

  // row s[from .. nk) in place: e^(s - max) over keys [lo, seen), zeros elsewhere; from and nk
  // multiples of L, from <= lo < seen <= nk; returns the sum
  static float softmax_row(float* s, int64_t from, int64_t lo, int64_t seen, int64_t nk) {
    for (int64_t j = from; j < lo; ++j) s[j] = kMasked;
    for (int64_t j = seen; j < nk; ++j) s[j] = kMasked;
    F m = V::set1(kMasked);
    for (int64_t j = from; j < nk; j += L) m = V::max(m, V::loadf(s + j));
    const F mx = V::set1(V::hmax(m));
    F sum = V::fzero();
    for (int64_t j = from; j < nk; j += L) {
      const F e = V::exp(V::sub(V::loadf(s + j), mx));
      sum = V::add(sum, e);
      V::store(s + j, e);
    }
    return V::sum(sum);
  }

  // o[r][e .. e + C * L) = sum_j p[r][j] v[j][e ..], rows r0 .. r0 + kR, keys [j0, j1)
  template <int C>
  void weighted_tile(const float* p, int64_t width, const float* vp, int64_t j0, int64_t j1,
                     int64_t r0, int64_t e, float* o) const {
    const int64_t D = a.D;
    F acc[kR][C];
    for (auto& row : acc)
      for (F& x : row) x = V::fzero();
    for (int64_t j = j0; j < j1; ++j) {
      F vv[C];
      for (int c = 0; c < C; ++c) vv[c] = V::loadf(vp + j * D + e + c * L);
      for (int r = 0; r < kR; ++r) {
        const F pv = V::set1(p[(r0 + r) * width + j]);
        for (int c = 0; c < C; ++c) acc[r][c] = V::fmadd(pv, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < C; ++c) V::store(o + (r0 + r) * D + e + c * L, acc[r][c]);
  }

  void weighted(const float* p, int64_t width, const float* vp, int64_t j0, int64_t j1,
                int64_t r0, float* o) const {
    int64_t e = 0;
    for (; e + kC * L <= a.D; e += kC * L) weighted_tile<kC>(p, width, vp, j0, j1, r0, e, o);
    switch ((a.D - e) / L) {  // the vectors left: fewer than kC
      case 3: weighted_tile<3>(p, width, vp, j0, j1, r0, e, o); break;
      case 2: weighted_tile<2>(p, width, vp, j0, j1, r0, e, o); break;
      case 1: weighted_tile<1>(p, width, vp, j0, j1, r0, e, o); break;
    }
  }

  // the first key the query at position pos sees
  int64_t visible_from(int64_t pos) const {
    return a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  }

  struct Scratch {
    std::vector<float> s, q, o, sum;  // [kRows, width] scores, [kRows, D] queries and outputs
  };

  // the queries [i0, i0 + kRows) of sequence s at head h
  void block(int64_t s, int64_t h, int64_t i0, const float* kt, const float* vp,
             Scratch& w, int64_t width) const {
    const int64_t n = a.lens[s], m_all = a.cu[s + 1] - a.cu[s], prefix = n - m_all, D = a.D;
    const int64_t m = std::min(kRows, m_all - i0), rows = (m + kR - 1) / kR * kR;
    const int64_t first = prefix + i0;       // the block's first query's position
    const int64_t seen_last = first + m;     // keys up to the block's last row's
    const int64_t nk = (seen_last + L - 1) / L * L;
    const int64_t lo_first = visible_from(first);  // the first key any row of the block sees
    const int64_t k_lo = lo_first / kKeys * kKeys;
    const T* q = static_cast<const T*>(a.q) + (a.cu[s] + i0) * a.q_ts + h * a.q_hs;
    const F scale = V::set1(a.scale);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; d += L)
        V::store(w.q.data() + r * D + d, r < m ? V::mul(V::load(q + r * a.q_ts + d), scale)
                                               : V::fzero());
    for (int64_t r0 = 0; r0 < rows; r0 += kR)
      for (int64_t k0 = k_lo; k0 < nk; k0 += kKeys)
        score_tile(w.q.data(), kt, r0, k0, w.s.data(), width);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min(first + r + 1, n);  // padding rows: every key
      w.sum[r] = softmax_row(w.s.data() + r * width, k_lo,
                             std::min(visible_from(first + r), seen - 1), seen, nk);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kR)
      weighted(w.s.data(), width, vp, lo_first, seen_last, r0, w.o.data());
    T* out = static_cast<T*>(a.out) + ((a.cu[s] + i0) * a.H + h) * D;
    for (int64_t r = 0; r < m; ++r) {
      const F inv = V::set1(1.0f / w.sum[r]);
      for (int64_t d = 0; d < D; d += L)
        V::store(out + r * a.H * D + d, V::mul(V::loadf(w.o.data() + r * D + d), inv));
    }
  }

  void run() const {
    const int64_t G = a.H / a.Hkv;
    std::vector<int64_t> k_at(a.S + 1, 0), v_at(a.S + 1, 0);  // packed floats before s's
    int64_t widest = 0;
    for (int64_t s = 0; s < a.S; ++s) {
      k_at[s + 1] = k_at[s] + padded(a.lens[s]) * a.D * a.Hkv;
      v_at[s + 1] = v_at[s] + a.lens[s] * a.D * a.Hkv;
      widest = std::max(widest, padded(a.lens[s]));
    }
    // (not value-initialized: pack writes every element)
    const std::unique_ptr<float[]> kt(new float[k_at[a.S]]), vp(new float[v_at[a.S]]);
    auto kt_of = [&](int64_t s, int64_t g) {
      return kt.get() + k_at[s] + g * padded(a.lens[s]) * a.D;
    };
    auto vp_of = [&](int64_t s, int64_t g) { return vp.get() + v_at[s] + g * a.lens[s] * a.D; };
    Work work = work_of(a, kRows);
    using pipellm::prefill::Cache;
    for_each_item<bool>(work.packs, [&](const Item& it, bool&) {
      float *kt_g = kt_of(it.s, it.h), *vp_g = vp_of(it.s, it.h);
      switch (a.cache) {
        case Cache::kSame: pack<T>(it.s, it.h, kt_g, vp_g); break;
        case Cache::kInt8: pack<int8_t>(it.s, it.h, kt_g, vp_g); break;
        case Cache::kFp8: pack<c10::Float8_e4m3fn>(it.s, it.h, kt_g, vp_g); break;
      }
    });
    for_each_item<Scratch>(work.blocks, [&](const Item& it, Scratch& w) {
      if (w.s.empty())
        w = Scratch{std::vector<float>(kRows * widest), std::vector<float>(kRows * a.D),
                    std::vector<float>(kRows * a.D), std::vector<float>(kRows)};
      const int64_t g = it.h / G;
      block(it.s, it.h, it.i0, kt_of(it.s, g), vp_of(it.s, g), w, widest);
    });
  }
};

template <class V>
void run_isa(const Args& a) {
  using pipellm::prefill::DType;
  switch (a.dtype) {
    case DType::kFloat: VecAttention<V, float>{a}.run(); break;
    case DType::kBFloat16: VecAttention<V, c10::BFloat16>{a}.run(); break;
    case DType::kHalf: VecAttention<V, c10::Half>{a}.run(); break;
  }
}

}  // namespace
