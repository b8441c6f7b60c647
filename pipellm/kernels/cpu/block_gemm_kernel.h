// The block GEMMs' kernel: one template over an instruction set's traits `Isa`, included by each
// block_gemm_<isa>.cpp inside its `#pragma GCC target` region and in an anonymous namespace, so
// that no two variants share a symbol the linker could pick from the wrong one.
//
// A unit is Isa::kLanes consecutive weight rows (one 16-row tile on AVX-512, half a tile on
// AVX2); one vector holds a value per row of a unit. Isa supplies the vectors (I: INT32 lanes,
// F: float lanes), loads, and the byte dot products of a block:
//   q4_step(acc, w, x)  acc += unsigned nibbles w . signed activations x (four bytes per lane);
//   q4_finish(acc)      the INT32 sums (AVX2 / AVX-512BW sum in INT16 and widen once a block);
//   q8_x(x), q8_step(acc, w, x)  signed weights . signed activations: with VNNI as
//                       (x + 128) . w, the block's 128 * sum(w) (`corr`) subtracted after;
//                       without it as |w| . (x with w's sign), exact with no correction.
// Each work item is up to kUnits units (kFewUnits in a step of up to kFewRows rows) over every
// activation row, kRows rows at a time (items in L2-sized groups, rows in L1-sized chunks:
// `run`). With Isa::kRolled the steps of a block stay a loop where a micro-kernel has several
// rows (unrolled, GCC spills AVX2's 16 registers). With Args::prefetch > 0, an item's first
// micro-kernel (rows from 0), which streams its weights from memory, prefetches them that many
// bytes ahead (a thread's tiles lie in a row, so it runs on across tiles); the later ones find
// them in cache.
#pragma once

namespace {

using namespace pipellm::block_gemm;

template <class Isa>
struct Kernel {
  using I = typename Isa::I;
  using F = typename Isa::F;
  static constexpr int kLanes = Isa::kLanes, kPerTile = kTile / Isa::kLanes;
  static constexpr int64_t kGroupBytes = 256 << 10, kChunkBytes = 4 << 10;

  const Args& a;
  int64_t nb;

  // the weight bytes of unit u, block b, vector v; the index of its first scale
  const uint8_t* wq(int64_t u, int64_t b, int v) const {
    const int64_t tile = u / kPerTile, half = u % kPerTile;
    return a.qs + (tile * nb + b) * (a.q8 ? 512 : 256) + v * 64 + half * kLanes * 4;
  }
  int64_t scale_at(int64_t u, int64_t b) const {
    return ((u / kPerTile) * nb + b) * kTile + (u % kPerTile) * kLanes;
  }

  // Step v of block b (k = 4v..4v+3, and 16+4v.. for Q4) for rows i0.. x units u0.., into dot.
  template <int TM, int TN, bool Q8>
  void block_step(int64_t i0, int64_t u0, int64_t b, int v, I (&dot)[TN][TM]) const {
    I lo[TN], hi[TN];
    for (int t = 0; t < TN; ++t) {
      lo[t] = Isa::load(wq(u0 + t, b, v));
      if constexpr (!Q8) {
        hi[t] = Isa::hi4(lo[t]);
        lo[t] = Isa::lo4(lo[t]);
      }
    }
    for (int r = 0; r < TM; ++r) {
      const int8_t* xr = a.xq + (i0 + r) * a.K + b * kBlock + 4 * v;
      if constexpr (Q8) {
        const I x = Isa::q8_x(Isa::bcast(xr));
        for (int t = 0; t < TN; ++t) dot[t][r] = Isa::q8_step(dot[t][r], lo[t], x);
      } else {
        const I xl = Isa::bcast(xr), xh = Isa::bcast(xr + 16);
        for (int t = 0; t < TN; ++t)
          dot[t][r] = Isa::q4_step(Isa::q4_step(dot[t][r], lo[t], xl), hi[t], xh);
      }
    }
  }

  // The INT32 dot products of block b for rows i0.. x units u0.., into dot[t][r].
  template <int TM, int TN, bool Q8>
  void block_dots(int64_t i0, int64_t u0, int64_t b, I (&dot)[TN][TM]) const {
    for (int t = 0; t < TN; ++t)
      for (int r = 0; r < TM; ++r) dot[t][r] = Isa::zero();
    constexpr int steps = Q8 ? 8 : 4;
    if constexpr (Isa::kRolled && TM > 1) {
#pragma GCC unroll 1
      for (int v = 0; v < steps; ++v) block_step<TM, TN, Q8>(i0, u0, b, v, dot);
    } else {
      for (int v = 0; v < steps; ++v) block_step<TM, TN, Q8>(i0, u0, b, v, dot);
    }
    if constexpr (!Q8)
      for (int t = 0; t < TN; ++t)
        for (int r = 0; r < TM; ++r) dot[t][r] = Isa::q4_finish(dot[t][r]);
  }

  // Touches the weight bytes and the scales a.prefetch bytes of weights ahead of unit u0's
  // block b (tile-blocks lie in a row: [tiles, nb, ...]). Always inlined: GCC takes a function
  // of prefetches alone for one without effects and drops the calls to it.
  template <bool Q8>
  [[gnu::always_inline]] void prefetch(int64_t u0, int64_t b) const {
    constexpr int64_t bytes = Q8 ? 512 : 256;
    const uint8_t* w = wq(u0, b, 0) + a.prefetch;
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(w + l);
    const int64_t s = scale_at(u0, b) + a.prefetch / bytes * kTile;
    __builtin_prefetch(a.d + s);
    if constexpr (!Q8) __builtin_prefetch(a.m + s);
    else if constexpr (Isa::kVnni) __builtin_prefetch(a.corr + s);
  }

  // Rows i0 .. i0 + TM of the output for units u0 .. u0 + TN.
  template <int TM, int TN, bool Q8, typename scalar_t>
  void micro(int64_t i0, int64_t u0, scalar_t* out) const {
    F acc[TN][TM];
    for (int t = 0; t < TN; ++t)
      for (int r = 0; r < TM; ++r) acc[t][r] = Isa::fzero();
    for (int64_t b = 0; b < nb; ++b) {
      if (a.prefetch > 0 && i0 == 0)  // each tile's stream (AVX2's two units share one)
        for (int t = 0; t < (kPerTile == 1 ? TN : 1); ++t) prefetch<Q8>(u0 + t, b);
      I dot[TN][TM];
      block_dots<TM, TN, Q8>(i0, u0, b, dot);
      for (int t = 0; t < TN; ++t) {
        const int64_t s = scale_at(u0 + t, b);
        const F d = Isa::load_half(a.d + s);
        const F m = Q8 ? (Isa::kVnni ? Isa::loadf(a.corr + s) : Isa::fzero())
                       : Isa::load_half(a.m + s);
        for (int r = 0; r < TM; ++r) {
          const int64_t k = (i0 + r) * nb + b;
          const F ds = Isa::mul(d, Isa::set1(a.xd[k]));
          if constexpr (Q8) {  // with VNNI: (x + 128) . w - 128 * sum(w) = x . w
            acc[t][r] = Isa::fmadd(Isa::sub(Isa::cvt(dot[t][r]), m), ds, acc[t][r]);
          } else {
            acc[t][r] = Isa::fmadd(Isa::cvt(dot[t][r]), ds, acc[t][r]);
            acc[t][r] = Isa::fmadd(m, Isa::set1(a.xs[k]), acc[t][r]);
          }
        }
      }
    }
    for (int t = 0; t < TN; ++t) {
      const int64_t n0 = (u0 + t) * kLanes, valid = std::min<int64_t>(kLanes, a.N - n0);
      for (int r = 0; r < TM; ++r) {
        alignas(64) float row[kLanes];
        Isa::storef(row, acc[t][r]);
        scalar_t* dst = out + (i0 + r) * a.N + n0;
        for (int64_t j = 0; j < valid; ++j)
          dst[j] = static_cast<scalar_t>(row[j] + (a.bias ? a.bias[n0 + j] : 0.f));
      }
    }
  }

  // Activation rows i0 .. i1 against units u0 .. u0 + TN: kRows rows at a time, then the rest.
  template <int TN, bool Q8, typename scalar_t>
  void rows(int64_t i0, int64_t i1, int64_t u0, scalar_t* out) const {
    int64_t i = i0;
    for (; i + Isa::kRows <= i1; i += Isa::kRows) micro<Isa::kRows, TN, Q8>(i, u0, out);
    tail<Isa::kRows - 1, TN, Q8>(i, i1 - i, u0, out);
  }
  template <int TM, int TN, bool Q8, typename scalar_t>
  void tail(int64_t i, int64_t left, int64_t u0, scalar_t* out) const {
    if constexpr (TM > 0) {
      if (left == TM) micro<TM, TN, Q8>(i, u0, out);
      else tail<TM - 1, TN, Q8>(i, left, u0, out);
    }
  }

  // A thread's work items in groups whose weights stay in L2 (kGroupBytes); for each group,
  // the activation rows a chunk at a time (kChunkBytes: the chunk stays in L1 while the
  // group's weights pass), so that neither side streams from further out once per item.
  template <bool Q8, typename scalar_t>
  void run(scalar_t* out) const {
    const int64_t units = (a.N + kLanes - 1) / kLanes;
    const int per_item = a.M <= Isa::kFewRows ? Isa::kFewUnits : Isa::kUnits;
    const int64_t items = (units + per_item - 1) / per_item;
    const int64_t item_bytes = per_item * kLanes * a.K / (Q8 ? 1 : 2);
    const int64_t group = std::max<int64_t>(1, kGroupBytes / item_bytes);
    const int64_t chunk = std::max<int64_t>(1, kChunkBytes / a.K / Isa::kRows) * Isa::kRows;
    at::parallel_for(0, items, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t g0 = p0; g0 < p1; g0 += group) {
        const int64_t g1 = std::min(p1, g0 + group);
        for (int64_t i0 = 0; i0 < a.M; i0 += chunk) {
          const int64_t i1 = std::min(a.M, i0 + chunk);
          for (int64_t p = g0; p < g1; ++p) {
            const int64_t u0 = p * per_item;
            if constexpr (Isa::kUnits == 2) {
              if (per_item == 2 && u0 + 1 < units) {
                rows<2, Q8>(i0, i1, u0, out);
                continue;
              }
            }
            rows<1, Q8>(i0, i1, u0, out);
          }
        }
      }
    });
  }
};

template <class Isa>
void run_isa(const Args& a) {
  const Kernel<Isa> k{a, a.K / kBlock};
  auto go = [&](auto* out) { a.q8 ? k.template run<true>(out) : k.template run<false>(out); };
  switch (a.out_type) {
    case OutType::kFloat: go(static_cast<float*>(a.out)); break;
    case OutType::kBFloat16: go(static_cast<c10::BFloat16*>(a.out)); break;
    case OutType::kHalf: go(static_cast<c10::Half*>(a.out)); break;
  }
}

}  // namespace
