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
// With kPairs (AVX-512 and bf16 caches of bf16 queries, on a CPU with AVX512-BF16; a pooling
// forward's: coarse_p), both products run as bf16 pairs summed in float32 (VDPBF16PS: twice the
// float FMA's work an instruction), FlashAttention's precision: K packed as [n_pad / L][D / 2][L]
// words (a word: one key's two adjacent dims), V as [n_pad / 2][D] words (two adjacent keys'
// values of one dim), the queries unscaled (the scores scaled as stored), P rounded to bf16.
#pragma once

namespace {

using pipellm::prefill::Args;

template <class V, typename T, bool kPairs = false>
struct VecAttention {
  using F = typename V::F;
  using Packed = std::conditional_t<kPairs, c10::BFloat16, float>;  // a packed K or V element
  static constexpr int L = V::kLanes;
  static constexpr int64_t kRows = 16;        // queries of a block
  // a micro-kernel: kR rows x kC vectors of accumulators, in the ISA's registers (32 / 16)
  static constexpr int kR = 4, kC = L == 16 ? 4 : 3;
  static constexpr int64_t kKeys = kC * L;    // keys a score pass covers
  static constexpr float kMasked = -1e30f;    // a hidden key's score (finite: -ffast-math)

  const Args& a;

  static int64_t padded(int64_t n) { return (n + kKeys - 1) / kKeys * kKeys; }
  static int64_t v_rows(int64_t n) { return kPairs ? padded(n) : n; }  // V's packed rows

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
      if constexpr (std::is_same_v<C, T> || std::is_same_v<C, c10::Half>) {
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

  // tile(std::integral_constant<int, C>{}, e) over the head dims: C = kC vectors from e at a
  // time, then the vectors left (fewer than kC)
  template <class Tile>
  void over_dims(const Tile& tile) const {
    int64_t e = 0;
    for (; e + kC * L <= a.D; e += kC * L) tile(std::integral_constant<int, kC>{}, e);
    switch ((a.D - e) / L) {
      case 3: tile(std::integral_constant<int, 3>{}, e); break;
      case 2: tile(std::integral_constant<int, 2>{}, e); break;
      case 1: tile(std::integral_constant<int, 1>{}, e); break;
    }
  }

  void weighted(const float* p, int64_t width, const float* vp, int64_t j0, int64_t j1,
                int64_t r0, float* o) const {
    over_dims([&](auto C, int64_t e) {
      weighted_tile<decltype(C)::value>(p, width, vp, j0, j1, r0, e, o);
    });
  }

  // kPairs: sequence s's KV head g (bf16 caches) packed in words, keys past n zero
  void pack_pairs(int64_t s, int64_t g, c10::BFloat16* kt, c10::BFloat16* vp) const {
    const int64_t n = a.lens[s], n_pad = padded(n), D = a.D;
    const auto* k = static_cast<const c10::BFloat16*>(a.k) + a.starts[s] * a.k_ts + g * a.k_hs;
    const auto* v = static_cast<const c10::BFloat16*>(a.v) + a.starts[s] * a.v_ts + g * a.v_hs;
    const __m512i keys = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(static_cast<int>(a.k_ts / 2)));
    auto* kw = reinterpret_cast<int32_t*>(kt);
    for (int64_t b = 0; b < n_pad / L; ++b) {
      const int64_t left = std::clamp<int64_t>(n - b * L, 0, L);
      const auto valid = static_cast<__mmask16>((1u << left) - 1);
      const int* base = reinterpret_cast<const int*>(k + b * L * a.k_ts);
      for (int64_t dp = 0; dp < D / 2; ++dp)
        _mm512_storeu_si512(kw + (b * (D / 2) + dp) * L, _mm512_mask_i32gather_epi32(
            _mm512_setzero_si512(), valid, keys, base + dp, 4));
    }
    auto row = [&](int64_t i, int64_t d) {  // 16 values of key i from dim d, as 32-bit lanes
      return i < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                         reinterpret_cast<const __m256i*>(v + i * a.v_ts + d)))
                   : _mm512_setzero_si512();
    };
    auto* vw = reinterpret_cast<int32_t*>(vp);
    for (int64_t t = 0; t < n_pad / 2; ++t)
      for (int64_t d = 0; d < D; d += L)
        _mm512_storeu_si512(vw + t * D + d, _mm512_or_si512(
            row(2 * t, d), _mm512_slli_epi32(row(2 * t + 1, d), 16)));
  }

  // kPairs: s[r][k0 .. k0 + kKeys) = scale * qb[r] . key, rows r0 .. r0 + kR
  void score_tile_pairs(const c10::BFloat16* qb, const c10::BFloat16* kt, int64_t r0,
                        int64_t k0, float* s, int64_t width) const {
    const int64_t half = a.D / 2;
    F acc[kR][kC];
    for (auto& row : acc)
      for (F& x : row) x = V::fzero();
    const auto* kw = reinterpret_cast<const int32_t*>(kt) + (k0 / L) * half * L;
    const auto* qw = reinterpret_cast<const int32_t*>(qb);
    for (int64_t dp = 0; dp < half; ++dp) {
      __m512bh kv[kC];
      for (int c = 0; c < kC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kw + (c * half + dp) * L);
      for (int r = 0; r < kR; ++r) {
        const auto qv = (__m512bh)_mm512_set1_epi32(qw[(r0 + r) * half + dp]);
        for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
      }
    }
    const F scale = V::set1(a.scale);
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < kC; ++c)
        V::store(s + (r0 + r) * width + k0 + c * L, V::mul(acc[r][c], scale));
  }

  // kPairs: o[r][e .. e + C * L) = sum_j p[r][j] v[j][e ..], rows r0 .. r0 + kR, key pairs
  // [t0, t1)
  template <int C>
  void weighted_tile_pairs(const c10::BFloat16* p, int64_t width, const c10::BFloat16* vp,
                           int64_t t0, int64_t t1, int64_t r0, int64_t e, float* o) const {
    const int64_t D = a.D, half = width / 2;
    F acc[kR][C];
    for (auto& row : acc)
      for (F& x : row) x = V::fzero();
    const auto* vw = reinterpret_cast<const int32_t*>(vp);
    const auto* pw = reinterpret_cast<const int32_t*>(p);
    for (int64_t t = t0; t < t1; ++t) {
      __m512bh vv[C];
      for (int c = 0; c < C; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vw + t * D + e + c * L);
      for (int r = 0; r < kR; ++r) {
        const auto pv = (__m512bh)_mm512_set1_epi32(pw[(r0 + r) * half + t]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, vv[c]);
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int c = 0; c < C; ++c) V::store(o + (r0 + r) * D + e + c * L, acc[r][c]);
  }

  void weighted_pairs(const c10::BFloat16* p, int64_t width, const c10::BFloat16* vp,
                      int64_t t0, int64_t t1, int64_t r0, float* o) const {
    over_dims([&](auto C, int64_t e) {
      weighted_tile_pairs<decltype(C)::value>(p, width, vp, t0, t1, r0, e, o);
    });
  }

  // the first key the query at position pos sees
  int64_t visible_from(int64_t pos) const {
    return a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0;
  }

  struct Scratch {
    std::vector<float> s, q, o, sum;  // [kRows, width] scores, [kRows, D] queries and outputs
    std::vector<c10::BFloat16> qb, p;  // kPairs: [kRows, D] queries, [kRows, width] P
  };

  // the queries [i0, i0 + kRows) of sequence s at head h
  void block(int64_t s, int64_t h, int64_t i0, const Packed* kt, const Packed* vp,
             Scratch& w, int64_t width) const {
    const int64_t n = a.lens[s], m_all = a.cu[s + 1] - a.cu[s], prefix = n - m_all, D = a.D;
    const int64_t m = std::min(kRows, m_all - i0), rows = (m + kR - 1) / kR * kR;
    const int64_t first = prefix + i0;       // the block's first query's position
    const int64_t seen_last = first + m;     // keys up to the block's last row's
    const int64_t nk = (seen_last + L - 1) / L * L;
    const int64_t lo_first = visible_from(first);  // the first key any row of the block sees
    const int64_t k_lo = lo_first / kKeys * kKeys;
    const T* q = static_cast<const T*>(a.q) + (a.cu[s] + i0) * a.q_ts + h * a.q_hs;
    if constexpr (kPairs) {
      for (int64_t r = 0; r < rows; ++r) {
        if (r < m) std::memcpy(w.qb.data() + r * D, q + r * a.q_ts, D * sizeof(T));
        else std::memset(w.qb.data() + r * D, 0, D * sizeof(T));
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kR)
        for (int64_t k0 = k_lo; k0 < nk; k0 += kKeys)
          score_tile_pairs(w.qb.data(), kt, r0, k0, w.s.data(), width);
    } else {
      const F scale = V::set1(a.scale);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; d += L)
          V::store(w.q.data() + r * D + d, r < m ? V::mul(V::load(q + r * a.q_ts + d), scale)
                                                 : V::fzero());
      for (int64_t r0 = 0; r0 < rows; r0 += kR)
        for (int64_t k0 = k_lo; k0 < nk; k0 += kKeys)
          score_tile(w.q.data(), kt, r0, k0, w.s.data(), width);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min(first + r + 1, n);  // padding rows: every key
      w.sum[r] = softmax_row(w.s.data() + r * width, k_lo,
                             std::min(visible_from(first + r), seen - 1), seen, nk);
    }
    if constexpr (kPairs) {  // P in bf16, pairs of keys from lo_first's down
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = r * width + k_lo; j < r * width + nk; j += L)
          V::store(w.p.data() + j, V::loadf(w.s.data() + j));
      for (int64_t r0 = 0; r0 < rows; r0 += kR)
        weighted_pairs(w.p.data(), width, vp, lo_first / 2, (seen_last + 1) / 2, r0, w.o.data());
    } else {
      for (int64_t r0 = 0; r0 < rows; r0 += kR)
        weighted(w.s.data(), width, vp, lo_first, seen_last, r0, w.o.data());
    }
    T* out = static_cast<T*>(a.out) + ((a.cu[s] + i0) * a.H + h) * D;
    for (int64_t r = 0; r < m; ++r) {
      const F inv = V::set1(1.0f / w.sum[r]);
      for (int64_t d = 0; d < D; d += L)
        V::store(out + r * a.H * D + d, V::mul(V::loadf(w.o.data() + r * D + d), inv));
    }
  }

  void run() const {
    const int64_t G = a.H / a.Hkv;
    static_assert(!kPairs || (L == 16 && std::is_same_v<T, c10::BFloat16>));
    std::vector<int64_t> k_at(a.S + 1, 0), v_at(a.S + 1, 0);  // packed elements before s's
    int64_t widest = 0;
    for (int64_t s = 0; s < a.S; ++s) {
      k_at[s + 1] = k_at[s] + padded(a.lens[s]) * a.D * a.Hkv;
      v_at[s + 1] = v_at[s] + v_rows(a.lens[s]) * a.D * a.Hkv;
      widest = std::max(widest, padded(a.lens[s]));
    }
    // (not value-initialized: pack writes every element)
    const std::unique_ptr<Packed[]> kt(new Packed[k_at[a.S]]), vp(new Packed[v_at[a.S]]);
    auto kt_of = [&](int64_t s, int64_t g) {
      return kt.get() + k_at[s] + g * padded(a.lens[s]) * a.D;
    };
    auto vp_of = [&](int64_t s, int64_t g) {
      return vp.get() + v_at[s] + g * v_rows(a.lens[s]) * a.D;
    };
    Work work = work_of(a, kRows);
    using pipellm::prefill::Cache;
    for_each_item<bool>(work.packs, [&](const Item& it, bool&) {
      Packed *kt_g = kt_of(it.s, it.h), *vp_g = vp_of(it.s, it.h);
      if constexpr (kPairs) {  // bf16 caches only (run_avx512_bf16)
        pack_pairs(it.s, it.h, kt_g, vp_g);
      } else {
        switch (a.cache) {
          case Cache::kSame: pack<T>(it.s, it.h, kt_g, vp_g); break;
          case Cache::kInt8: pack<int8_t>(it.s, it.h, kt_g, vp_g); break;
          case Cache::kFp8: pack<c10::Float8_e4m3fn>(it.s, it.h, kt_g, vp_g); break;
          case Cache::kHalf: pack<c10::Half>(it.s, it.h, kt_g, vp_g); break;
        }
      }
    });
    for_each_item<Scratch>(work.blocks, [&](const Item& it, Scratch& w) {
      if (w.s.empty()) {
        const int64_t pairs = kPairs ? kRows : 0, floats = kPairs ? 0 : kRows;
        w = Scratch{std::vector<float>(kRows * widest), std::vector<float>(floats * a.D),
                    std::vector<float>(kRows * a.D), std::vector<float>(kRows),
                    std::vector<c10::BFloat16>(pairs * a.D),
                    std::vector<c10::BFloat16>(pairs * widest)};
      }
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
