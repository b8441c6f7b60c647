// Block-quantized GEMMs on the CPU: 4-bit (a GGUF's Q4_0/Q4_1, or ours) and 8-bit (Q8_0) weight
// blocks against the activations quantized to INT8 in blocks of 32 on the fly (llama.cpp's
// Q4_1 x Q8_1 and Q8_0 x Q8_0 schemes), INT32 dot products with AVX512-VNNI (vpdpbusd: unsigned
// x signed bytes), float scales once per block. The CPU twins of kernels/int4_gemm.py's
// `int4_gemm` and kernels/q8_gemm.py's `q8_gemm`; references `int4_q8_gemm_ref`, `q8_gemm_ref`.
//
// Weights (packed once at load by `pack_int4_vnni` / `pack_q8_vnni`), N padded to a multiple of
// 16 (padding rows are zeros), K a multiple of 32; per tile of 16 output rows and block b of 32 k:
//   Q4 qs uint8 [N / 16, K / 32, 4, 64]  vector v: lane t (row 16 tile + t) bytes 4t..4t+3 hold
//      k = 4v..4v+3 of the block in their low nibbles and k = 16+4v..16+4v+3 in the high ones
//   Q8 qs int8 [N / 16, K / 32, 8, 64]   vector v: lane t bytes 4t..4t+3 hold k = 4v..4v+3
//   d  fp16 [N / 16, K / 32, 16]  block scale
//   Q4 m fp16 (same shape) block min: w = q * d + m, q in 0..15.   Q8: w = q * d, and
//   corr float (same shape) = 128 * sum(q) of the block (the activations enter as x + 128)
// Activations x [M, K] (float32, bfloat16 or float16), quantized per row and block of 32:
//   xq = round(x / dx), dx = max|x| / 127;  sx = dx * sum(xq) (what Q4's min multiplies)
// out[i, n] = sum_b d[n,b] dx[i,b] (q[n,b] . xq[i,b]) (+ m[n,b] sx[i,b])  (+ bias[n]),
// accumulated in float32, returned [M, N] in x's dtype.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PIPELLM_VNNI 1
#endif

namespace {

constexpr int64_t kBlock = 32, kTile = 16;

struct Quantized {  // x [M, K] as INT8 blocks
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d, s;  // [M, K / 32]: scale, scale * sum(q)
};

template <typename scalar_t>
Quantized quantize_rows(const scalar_t* x, int64_t M, int64_t K, int64_t stride) {
  const int64_t nb = K / kBlock;
  Quantized out{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        const scalar_t* src = x + i * stride + b * kBlock;
        float v[kBlock], amax = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) {
          v[j] = static_cast<float>(src[j]);
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q = out.q.data() + i * K + b * kBlock;
        int32_t sum = 0;
        for (int64_t j = 0; j < kBlock; ++j) {
          q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
          sum += q[j];
        }
        out.d[i * nb + b] = amax / 127.f;
        out.s[i * nb + b] = amax / 127.f * static_cast<float>(sum);
      }
    }
  });
  return out;
}

#ifdef PIPELLM_VNNI
struct Weight {  // one packed weight; Q8 when corr is set
  const uint8_t* qs;
  const at::Half* d;
  const at::Half* m;  // Q4: the block mins
  const float* corr;  // Q8: 128 * each block's weight sum
  int64_t nb, block_bytes;  // blocks per row; bytes per (tile, block): 256 (Q4) or 512 (Q8)
  const uint8_t* q(int64_t tile, int64_t b) const { return qs + (tile * nb + b) * block_bytes; }
  __m512 scale(const at::Half* p, int64_t tile, int64_t b) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (tile * nb + b) * kTile)));
  }
  __m512 correction(int64_t tile, int64_t b) const {
    return _mm512_loadu_ps(corr + (tile * nb + b) * kTile);
  }
};

template <typename scalar_t>
inline void store_row(scalar_t* dst, __m512 v, int64_t valid) {
  alignas(64) float tmp[kTile];
  _mm512_store_ps(tmp, v);
  for (int64_t t = 0; t < valid; ++t) dst[t] = static_cast<scalar_t>(tmp[t]);
}

template <>
inline void store_row<float>(float* dst, __m512 v, int64_t valid) {
  _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << valid) - 1), v);
}

// The dot products of one block for TM rows x TN tiles, into dot[t][r] (INT32 lanes = rows n).
// Q4: 4 vectors, each a low (k = 4v..) and a high (k = 16 + 4v..) nibble half, unsigned.
// Q8: 8 signed vectors (k = 4v..); the activations go in unsigned, x + 128 (the weight sums
// times 128 come off in the epilogue), as vpdpbusd multiplies unsigned by signed bytes.
template <int TM, int TN, bool Q8>
inline void block_dots(const Weight& w, const Quantized& x, int64_t K, int64_t i0, int64_t tile0,
                       int64_t b, __m512i (&dot)[TN][TM]) {
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int t = 0; t < TN; ++t)
    for (int r = 0; r < TM; ++r) dot[t][r] = _mm512_setzero_si512();
  for (int v = 0; v < (Q8 ? 8 : 4); ++v) {
    __m512i lo[TN], hi[TN];
    for (int t = 0; t < TN; ++t) {
      lo[t] = _mm512_loadu_si512(w.q(tile0 + t, b) + v * 64);
      if constexpr (!Q8) {
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(lo[t], 4), low);
        lo[t] = _mm512_and_si512(lo[t], low);
      }
    }
    for (int r = 0; r < TM; ++r) {
      const int8_t* xr = x.q.data() + (i0 + r) * K + b * kBlock + 4 * v;
      const __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr));
      if constexpr (Q8) {
        const __m512i xu = _mm512_xor_si512(xl, flip);
        for (int t = 0; t < TN; ++t) dot[t][r] = _mm512_dpbusd_epi32(dot[t][r], xu, lo[t]);
      } else {
        const __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 16));
        for (int t = 0; t < TN; ++t) {
          dot[t][r] = _mm512_dpbusd_epi32(dot[t][r], lo[t], xl);
          dot[t][r] = _mm512_dpbusd_epi32(dot[t][r], hi[t], xh);
        }
      }
    }
  }
}

// Rows i0 .. i0 + TM of the output against TN tiles of 16 weight rows from `tile0`.
template <int TM, int TN, bool Q8, typename scalar_t>
void micro(const Weight& w, const Quantized& x, int64_t K, int64_t i0, int64_t tile0,
           const float* bias, int64_t N, scalar_t* out) {
  const int64_t nb = w.nb;
  __m512 acc[TN][TM];
  for (int t = 0; t < TN; ++t)
    for (int r = 0; r < TM; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i dot[TN][TM];
    block_dots<TM, TN, Q8>(w, x, K, i0, tile0, b, dot);
    for (int t = 0; t < TN; ++t) {
      const __m512 d = w.scale(w.d, tile0 + t, b);
      const __m512 m = Q8 ? w.correction(tile0 + t, b) : w.scale(w.m, tile0 + t, b);
      for (int r = 0; r < TM; ++r) {
        const int64_t k = (i0 + r) * nb + b;
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(x.d[k]));
        if constexpr (Q8) {  // (x + 128) . w - 128 * sum(w) = x . w
          acc[t][r] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(dot[t][r]), m), ds,
                                      acc[t][r]);
        } else {
          acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][r]), ds, acc[t][r]);
          acc[t][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[k]), acc[t][r]);
        }
      }
    }
  }
  for (int t = 0; t < TN; ++t) {
    const int64_t n0 = (tile0 + t) * kTile, valid = std::min<int64_t>(kTile, N - n0);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1), bias + n0)
                           : _mm512_setzero_ps();
    for (int r = 0; r < TM; ++r) store_row(out + (i0 + r) * N + n0, _mm512_add_ps(acc[t][r], bv), valid);
  }
}

template <int TN, bool Q8, typename scalar_t>
void rows_tiles(const Weight& w, const Quantized& x, int64_t M, int64_t K, int64_t tile0,
                const float* bias, int64_t N, scalar_t* out) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) micro<4, TN, Q8>(w, x, K, i, tile0, bias, N, out);
  switch (M - i) {
    case 3: micro<3, TN, Q8>(w, x, K, i, tile0, bias, N, out); break;
    case 2: micro<2, TN, Q8>(w, x, K, i, tile0, bias, N, out); break;
    case 1: micro<1, TN, Q8>(w, x, K, i, tile0, bias, N, out); break;
    default: break;
  }
}

// Work items of two tiles (32 output rows), each over every activation row.
template <bool Q8, typename scalar_t>
void run(const Quantized& x, int64_t M, int64_t K, int64_t N, const Weight& w, const float* bias,
         scalar_t* out) {
  const int64_t tiles = (N + kTile - 1) / kTile, pairs = (tiles + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (2 * p + 1 < tiles) rows_tiles<2, Q8>(w, x, M, K, 2 * p, bias, N, out);
      else rows_tiles<1, Q8>(w, x, M, K, 2 * p, bias, N, out);
    }
  });
}
#endif

torch::Tensor gemm(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                   const torch::Tensor& extra, int64_t N, const std::optional<torch::Tensor>& bias,
                   bool q8) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + kTile - 1) / kTile, nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && (qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar) && qs.is_contiguous() &&
              qs.numel() == tiles * nb * (q8 ? 512 : 256), "qs is not a packed [N, K] weight");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == tiles * nb * kTile &&
              extra.is_contiguous() && extra.numel() == d.numel() &&
              extra.scalar_type() == (q8 ? at::kFloat : at::kHalf),
              "scales must be [N / 16, K / 32, 16]: fp16 d, and fp16 mins (Q4) or float sums (Q8)");
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must have N elements");
  }
  auto out = torch::empty({M, N}, x.options());
#ifdef PIPELLM_VNNI
  const Weight w{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(),
                 q8 ? nullptr : extra.data_ptr<at::Half>(), q8 ? extra.data_ptr<float>() : nullptr,
                 nb, q8 ? 512 : 256};
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q4_gemm", [&] {
    const Quantized xq = quantize_rows(x.data_ptr<scalar_t>(), M, K, x.stride(0));
    if (q8) run<true>(xq, M, K, N, w, bp, out.data_ptr<scalar_t>());
    else run<false>(xq, M, K, N, w, bp, out.data_ptr<scalar_t>());
  });
#else
  TORCH_CHECK(false, "the INT4/INT8 block GEMMs need a CPU with AVX512-VNNI");
#endif
  return out;
}

}  // namespace

// Whether this build has the kernels (a CPU with AVX512-VNNI when it was compiled).
bool q4_gemm_available() {
#ifdef PIPELLM_VNNI
  return true;
#else
  return false;
#endif
}

// x [M, K] (rows contiguous); qs, d, m from pack_int4_vnni for N output rows; bias float [N] or
// None. Returns [M, N] in x's dtype.
torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                      int64_t N, std::optional<torch::Tensor> bias) {
  return gemm(x, qs, d, m, N, bias, false);
}

// The same for 8-bit weight blocks (a GGUF's Q8_0; pack_int8_vnni): qs int8 [N / 16, K / 32, 8,
// 16, 4] (vector v: k = 4v..4v+3), d fp16 scales, corr float 128 * the blocks' weight sums.
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor corr,
                      int64_t N, std::optional<torch::Tensor> bias) {
  return gemm(x, qs, d, corr, N, bias, true);
}
