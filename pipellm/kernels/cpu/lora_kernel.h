// The segmented LoRA delta (pipellm/kernels/lora.py's lora_delta_), a template over an ISA's float
// vector traits `V` (simd_avx2.h, simd_avx512.h), included by each lora_<isa>.cpp inside its
// target region. Two passes, each a set of equal work items shared by the threads:
//   shrink: for each group and block of kMR of its rows, h[rows] = x[rows] @ a[slot], R in
//           chunks of up to kNR vectors, accumulators in registers;
//   expand: for each group and chunk of kNR vectors of out, every block of kMR of its rows
//           y[rows] += h[rows] @ b[slot], accumulated in registers, y read and written once;
//           only b's rows of the parts the chunk's columns are in (the rest are zeros).
// Math in float32; y rounded once.
#pragma once

namespace {

using pipellm::lora::Args;
using pipellm::lora::DType;
using pipellm::lora::part_rows;
using pipellm::lora::row_blocks;

constexpr int64_t kMR = 4;  // rows a block

template <class V>
constexpr int kNR = V::kLanes == 16 ? 4 : 2;  // vectors a chunk (registers: kMR x kNR + kNR)

// h[rows[i0 .. i0 + m)][c0 .. c0 + NR lanes) = x[those rows] @ a_s[:, same columns]
template <class V, int NR, typename T>
void shrink_chunk(const Args& a, const T* as, int64_t i0, int64_t m, int64_t c0) {
  typename V::F acc[kMR][NR];
  const T* xr[kMR];
  for (int64_t r = 0; r < kMR; ++r) {
    xr[r] = static_cast<const T*>(a.x) + a.rows[i0 + std::min(r, m - 1)] * a.x_rs;
    for (int c = 0; c < NR; ++c) acc[r][c] = V::fzero();
  }
  for (int64_t k = 0; k < a.in; ++k) {
    typename V::F w[NR];
    for (int c = 0; c < NR; ++c) w[c] = V::load(as + k * a.R + c0 + c * V::kLanes);
    for (int64_t r = 0; r < kMR; ++r) {
      const typename V::F xv = V::set1(static_cast<float>(xr[r][k]));
      for (int c = 0; c < NR; ++c) acc[r][c] = V::fmadd(xv, w[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < m; ++r)
    for (int c = 0; c < NR; ++c) V::store(a.h + (i0 + r) * a.R + c0 + c * V::kLanes, acc[r][c]);
}

// y[rows[i0 .. i0 + m)][o0 .. o0 + NR lanes) += h[those rows] @ b_s[:, same columns]
template <class V, int NR, typename T, typename Y>
void expand_chunk(const Args& a, const T* bs, int64_t i0, int64_t m, int64_t o0, int64_t k0,
                  int64_t k1) {
  typename V::F acc[kMR][NR];
  for (int64_t r = 0; r < kMR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = V::fzero();
  const float* hr = a.h + i0 * a.R;
  for (int64_t k = k0; k < k1; ++k) {
    typename V::F w[NR];
    for (int c = 0; c < NR; ++c) w[c] = V::load(bs + k * a.out + o0 + c * V::kLanes);
    for (int64_t r = 0; r < kMR; ++r) {  // rows past m read row m - 1's h (not stored)
      const typename V::F hv = V::set1(hr[std::min(r, m - 1) * a.R + k]);
      for (int c = 0; c < NR; ++c) acc[r][c] = V::fmadd(hv, w[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    Y* yr = static_cast<Y*>(a.y) + a.rows[i0 + r] * a.y_rs + o0;
    for (int c = 0; c < NR; ++c)
      V::store(yr + c * V::kLanes, V::add(V::load(yr + c * V::kLanes), acc[r][c]));
  }
}

// f(nr) with nr vectors (1 .. kNR) a compile-time constant
template <class V, class F>
void with_width(int64_t vectors, const F& f) {
  switch (vectors) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: if constexpr (kNR<V> >= 3) return f(std::integral_constant<int, 3>{});
            [[fallthrough]];
    default: return f(std::integral_constant<int, kNR<V>>{});
  }
}

template <class V, typename T, typename Y>
void run_typed(const Args& a) {
  const auto blocks = row_blocks(a, kMR);
  const int64_t B = static_cast<int64_t>(blocks.size());
  const int64_t width = kNR<V> * V::kLanes;  // floats a chunk
  const T* as = static_cast<const T*>(a.a);
  const T* bs = static_cast<const T*>(a.b);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const auto& [g, i0, m] = blocks[j];
      const T* ag = as + a.slots[g] * a.in * a.R;
      for (int64_t c0 = 0; c0 < a.R; c0 += width)
        with_width<V>((std::min(width, a.R - c0)) / V::kLanes, [&](auto nr) {
          shrink_chunk<V, decltype(nr)::value, T>(a, ag, i0, m, c0);
        });
    }
  });
  const int64_t chunks = (a.out + width - 1) / width;
  at::parallel_for(0, a.G * chunks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t g = j / chunks, o0 = (j % chunks) * width;
      const T* bg = bs + a.slots[g] * a.R * a.out;
      const int64_t o1 = std::min(a.out, o0 + width);
      const auto [k0, k1] = part_rows(a, o0, o1);
      with_width<V>((o1 - o0) / V::kLanes, [&](auto nr) {
        for (int64_t i0 = a.starts[g]; i0 < a.starts[g + 1]; i0 += kMR)
          expand_chunk<V, decltype(nr)::value, T, Y>(
              a, bg, i0, std::min(kMR, a.starts[g + 1] - i0), o0, k0, k1);
      });
    }
  });
}

template <class V, typename T>
void run_x(const Args& a) {
  switch (a.y_dtype) {
    case DType::kFloat: return run_typed<V, T, float>(a);
    case DType::kBFloat16: return run_typed<V, T, c10::BFloat16>(a);
    case DType::kHalf: return run_typed<V, T, c10::Half>(a);
  }
}

template <class V>
void run_isa(const Args& a) {
  switch (a.x_dtype) {
    case DType::kFloat: return run_x<V, float>(a);
    case DType::kBFloat16: return run_x<V, c10::BFloat16>(a);
    case DType::kHalf: return run_x<V, c10::Half>(a);
  }
}

}  // namespace
