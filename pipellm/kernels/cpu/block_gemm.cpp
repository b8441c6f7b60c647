// Block-quantized GEMMs on the CPU: 4-bit (a GGUF's Q4_0/Q4_1, or ours) and 8-bit (Q8_0) weight
// blocks against the activations quantized to INT8 in blocks of 32 on the fly (llama.cpp's
// Q4_1 x Q8_1 and Q8_0 x Q8_0 schemes), INT32 dot products of bytes, float scales once per
// block. The CPU twins of pipellm/kernels/int4_gemm.py's `int4_gemm` and pipellm/kernels/q8_gemm.py's
// `q8_gemm`; references `int4_q8_gemm_ref`, `q8_gemm_ref`.
//
// This file checks the tensors, quantizes the activations and calls the kernel of the ISA level
// chosen at run time (`set_block_gemm_isa`, from pipellm/kernels/cpu/isa.py): block_gemm_avx2.cpp,
// block_gemm_avx2_vnni.cpp, block_gemm_avx512.cpp, block_gemm_avx512_vnni.cpp, one template
// (block_gemm_kernel.h) each compiled for its instruction set into the same build.
//
// Weights (packed once at load by `pack_int4_blocks` / `pack_q8_blocks`), N padded to a multiple of
// 16 (padding rows are zeros), K a multiple of 32; per tile of 16 output rows and block b of 32 k:
//   Q4 qs uint8 [N / 16, K / 32, 4, 64]  vector v: lane t (row 16 tile + t) bytes 4t..4t+3 hold
//      k = 4v..4v+3 of the block in their low nibbles and k = 16+4v..16+4v+3 in the high ones
//   Q8 qs int8 [N / 16, K / 32, 8, 64]   vector v: lane t bytes 4t..4t+3 hold k = 4v..4v+3
//   d  fp16 [N / 16, K / 32, 16]  block scale
//   Q4 m fp16 (same shape) block min: w = q * d + m, q in 0..15.   Q8: w = q * d, and
//   corr float (same shape) = 128 * sum(q) of the block (VNNI: the activations enter as x + 128)
// Activations x [M, K] (float32, bfloat16 or float16), quantized per row and block of 32:
//   xq = round(x / dx), dx = max|x| / 127;  sx = dx * sum(xq) (what Q4's min multiplies)
// out[i, n] = sum_b d[n,b] dx[i,b] (q[n,b] . xq[i,b]) (+ m[n,b] sx[i,b])  (+ bias[n]),
// accumulated in float32, returned [M, N] in x's dtype.
#include <ATen/Parallel.h>
#include "tensor.h"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "block_gemm.h"
#if defined(__AVX2__)
#include <immintrin.h>

#include "simd_avx2.h"  // Avx2F: the whole file is compiled for AVX2 (the extension's floor)
#endif

namespace {

using namespace pipellm::block_gemm;

struct Quantized {  // x [M, K] as INT8 blocks
  std::vector<int8_t> q;  // [M, K]
  std::vector<float> d, s;  // [M, K / 32]: scale, scale * sum(q)
};

#if defined(__AVX2__)
inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One block of 32 values: q = round(x / d) with d = max|x| / 127, as the scalar loop below
// (the same float operations, rounding to nearest even); returns sum(q).
template <typename scalar_t>
int32_t quantize_block(const scalar_t* src, int8_t* q, float* amax_out) {
  __m256 v[4], amax = Avx2F::fzero();
  const __m256 sign = Avx2F::set1(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = Avx2F::load(src + 8 * i);
    amax = Avx2F::max(amax, _mm256_andnot_ps(sign, v[i]));
  }
  const float m = Avx2F::hmax(amax);
  const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
  __m256i r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                           _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(
      bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));  // packs interleave 128-bit lanes
  *amax_out = m;
  return hsum8i(_mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])));
}
#else
template <typename scalar_t>
int32_t quantize_block(const scalar_t* src, int8_t* q, float* amax_out) {
  float v[kBlock], amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) {
    v[j] = static_cast<float>(src[j]);
    amax = std::max(amax, std::fabs(v[j]));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
    sum += q[j];
  }
  *amax_out = amax;
  return sum;
}
#endif

template <typename scalar_t>
Quantized quantize_rows(const scalar_t* x, int64_t M, int64_t K, int64_t stride) {
  const int64_t nb = K / kBlock;
  Quantized out{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        float amax;
        const int32_t sum = quantize_block(x + i * stride + b * kBlock,
                                           out.q.data() + i * K + b * kBlock, &amax);
        out.d[i * nb + b] = amax / 127.f;
        out.s[i * nb + b] = amax / 127.f * static_cast<float>(sum);
      }
    }
  });
  return out;
}

// What each level needs of the CPU (and what the ones below it need)
#if defined(__x86_64__) && defined(__GNUC__)
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avx2_vnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool has_avx512_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }
#else
bool has_avx2() { return false; }
bool has_avx2_vnni() { return false; }
bool has_avx512() { return false; }
bool has_avx512_vnni() { return false; }
#endif

// `prefetch`: bytes ahead the pass that streams the weights prefetches them (Args::prefetch), as
// measured on each level (bench/cpu_gemm.py's prefetch column, docs/benchmarks.md).
struct Level {
  const char* name;
  void (*run)(const Args&);
  bool (*supported)();
  int64_t prefetch;
};
constexpr Level kLevels[] = {
    {"avx2", run_avx2, has_avx2, 2048},
    {"avx2_vnni", run_avx2_vnni, has_avx2_vnni, 2048},
    {"avx512", run_avx512, has_avx512, 2048},
    {"avx512_vnni", run_avx512_vnni, has_avx512_vnni, 2048},
};
const Level* chosen = nullptr;  // set once at load, before any call
int64_t prefetch = -1;  // set_block_gemm_prefetch's bytes; -1: the chosen level's
int64_t prefetch_bytes() { return prefetch < 0 ? chosen->prefetch : prefetch; }

OutType out_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return OutType::kFloat;
    case at::kBFloat16: return OutType::kBFloat16;
    case at::kHalf: return OutType::kHalf;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
  }
}

void check_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& extra,
                  int64_t K, int64_t N, bool q8) {
  TORCH_CHECK(chosen != nullptr, "no block GEMM kernel for this CPU (set_block_gemm_isa)");
  const int64_t tiles = (N + kTile - 1) / kTile, nb = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && (qs.scalar_type() == at::kByte || qs.scalar_type() == at::kChar) && qs.is_contiguous() &&
              qs.numel() == tiles * nb * (q8 ? 512 : 256), "qs is not a packed [N, K] weight");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == tiles * nb * kTile &&
              extra.is_contiguous() && extra.numel() == d.numel() &&
              extra.scalar_type() == (q8 ? at::kFloat : at::kHalf),
              "scales must be [N / 16, K / 32, 16]: fp16 d, and fp16 mins (Q4) or float sums (Q8)");
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                   const at::Tensor& extra, int64_t N, const std::optional<at::Tensor>& bias,
                   bool q8) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  check_weight(qs, d, extra, K, N, q8);
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must have N elements");
  }
  auto out = at::empty({M, N}, x.options());
  const OutType type = out_type(x.scalar_type());
  AT_DISPATCH_V2(x.scalar_type(), "block_gemm", AT_WRAP([&] {
    const Quantized xq = quantize_rows(x.data_ptr<scalar_t>(), M, K, x.stride(0));
    const Args args{xq.q.data(), xq.d.data(), xq.s.data(), M, K, N,
                    static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(),
                    q8 ? nullptr : extra.data_ptr<at::Half>(),
                    q8 ? extra.data_ptr<float>() : nullptr, q8,
                    bias.has_value() ? b.data_ptr<float>() : nullptr, out.data_ptr(), type,
                    prefetch_bytes()};
    chosen->run(args);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

}  // namespace

// Chooses the kernel variant of `level` (pipellm/kernels/cpu/isa.py's names; "" for none) for every
// later call; refuses a level this CPU lacks (which would die of an illegal instruction).
void set_block_gemm_isa(const std::string& level) {
  if (level.empty()) {
    chosen = nullptr;
    return;
  }
  const Level* found = nullptr;
  for (const Level& l : kLevels)
    if (level == l.name) found = &l;
  TORCH_CHECK(found != nullptr, "unknown ISA level '", level, "'");
  TORCH_CHECK(found->supported(), "this CPU does not run the ", level, " kernels");
  chosen = found;
}

// Bytes ahead the pass that streams the weights prefetches them, at every level (0: none; -1:
// each level's own, the default): for benchmarks (bench/cpu_gemm.py).
void set_block_gemm_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= -1, "prefetch bytes must be -1 (the level's), 0 (none) or more");
  prefetch = bytes;
}

// The level the block GEMMs run ("" when none was chosen: the callers fall back to PyTorch).
std::string block_gemm_isa() { return chosen ? chosen->name : ""; }

// The vector width the other kernels run at the chosen level: "avx512" for every AVX-512 level,
// "avx2" for avx2 and avx2_vnni, "" when none was chosen.
std::string vector_isa() {
  const std::string level = block_gemm_isa();
  if (level.rfind("avx512", 0) == 0) return "avx512";
  return level.rfind("avx2", 0) == 0 ? "avx2" : "";
}

// x [M, K] (rows contiguous); qs, d, m from pack_int4_blocks for N output rows; bias float [N]
// or None. Returns [M, N] in x's dtype.
at::Tensor q4_gemm(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor m,
                      int64_t N, std::optional<at::Tensor> bias) {
  return gemm(x, qs, d, m, N, bias, false);
}

// The same for 8-bit weight blocks (a GGUF's Q8_0; pack_q8_blocks): qs int8 [N / 16, K / 32, 8,
// 16, 4] (vector v: k = 4v..4v+3), d fp16 scales, corr float 128 * the blocks' weight sums.
at::Tensor q8_gemm(at::Tensor x, at::Tensor qs, at::Tensor d, at::Tensor corr,
                      int64_t N, std::optional<at::Tensor> bias) {
  return gemm(x, qs, d, corr, N, bias, true);
}

// Activations quantized already, one scale a row (W8A8's per-token INT8: xq int8 [M, K] with
// contiguous rows, x_scale float [M]), x 8-bit weight blocks as for q8_gemm: every block of a
// row takes its row's scale. Returns float32 [M, N]: with blocks of scale 1 (pipellm/kernels/int8_gemm.py),
// x_scale[m] times the exact INT32 sum, up to float rounding.
at::Tensor q8_gemm_int8_rows(at::Tensor xq, at::Tensor x_scale, at::Tensor qs,
                                at::Tensor d, at::Tensor corr, int64_t N) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(),
              "xq must be int8 [M, K], contiguous");
  const int64_t M = xq.size(0), K = xq.size(1);
  check_weight(qs, d, corr, K, N, true);
  const at::Tensor scale = x_scale.to(at::kFloat).contiguous();
  TORCH_CHECK(scale.numel() == M, "x_scale must have M elements");
  const at::Tensor xd = scale.unsqueeze(1).expand({M, K / kBlock}).contiguous();  // Args' xd
  auto out = at::empty({M, N}, xq.options().dtype(at::kFloat));
  const Args args{xq.data_ptr<int8_t>(), xd.data_ptr<float>(), nullptr,  // xs: Q4's mins only
                  M, K, N, static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(),
                  nullptr, corr.data_ptr<float>(), true, nullptr, out.data_ptr(),
                  OutType::kFloat, prefetch_bytes()};
  if (M > 0) chosen->run(args);
  return out;
}
