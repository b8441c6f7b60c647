// Decode attention on the CPU over the contiguous KV cache: the CPU twin of the Triton kernel in
// pipellm/kernels/decode_attention.py (same arguments, same layout), with pipellm/kernels/decode_attention.py's
// decode_attention_reference as its reference.
//
// q [B, H, D]; k_cache, v_cache [capacity, Hkv, D] (one layer, rows contiguous in D);
// seq_starts, seq_lens int32 [B]: sequence b owns slots [start, start + len), len >= 1.
// window > 0 (a sliding-window layer): the query, at position len - 1, sees only the last
// min(len, window) keys, positions (len - 1 - window, len - 1]; the rows before are not read.
// softcap > 0 (Gemma 2's attn_logit_softcapping): each score s = scale * q.k becomes
// softcap * tanh(s / softcap) before the softmax; 0: none.
// The caches are q's dtype, fp16 under float32 queries (--kv-cache-dtype float16), or INT8.
// The vectorized variants (decode_attention_kernel.h, one per ISA level: the level the block
// GEMMs run, set_block_gemm_isa) take float caches with head_dim a multiple of 8 up to 256
// (`variant`); the generic code below takes the rest (INT8 caches, other head sizes, a CPU
// below AVX2).
// Generic path: one work item per sequence: it walks the sequence's K rows (all kv heads: contiguous memory)
// once, scoring every query head h against kv head h / (H / Hkv) in fp32, then its V rows once.
// Walking whole rows rather than one head's slice per item runs at ~90% of memory bandwidth,
// 2x the per-(sequence, head) split. fp16 rows are widened to float once per row (F16C) before
// the loops read them. Items run in parallel on ATen's thread pool.
// Returns [B, H, D] in q's dtype.
#include <ATen/Parallel.h>
#include "tensor.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "decode_attention.h"
#include "decode_attention_schedule.h"
#if defined(__AVX2__)
#include <immintrin.h>

#include "simd_avx2.h"  // Avx2F: the whole file is compiled for AVX2 (the extension's floor)
#endif

std::string vector_isa();  // block_gemm.cpp: avx512, avx2 or "" at the chosen level

namespace {

constexpr int64_t kGroup = 8;  // INT8 caches: one fp16 scale per 8 values (pipellm/kernels/kv_quant.py)

// Element d of a K or V head row as float: the value, or the INT8 value times its group's scale.
template <typename cache_t>
inline float load(const cache_t* r, const at::Half* s, int64_t d) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    return static_cast<float>(r[d]) * static_cast<float>(s[d / kGroup]);
  } else {
    return static_cast<float>(r[d]);
  }
}

// Where the scales of K/V row t, kv head h live (INT8 caches; nullptr otherwise).
struct Scales {
  const at::Half* k = nullptr;
  const at::Half* v = nullptr;
  int64_t row_stride = 0, head_stride = 0;
  const at::Half* at(const at::Half* base, int64_t t, int64_t h) const {
    return base ? base + t * row_stride + h * head_stride : nullptr;
  }
};

// f[i] = r[i] for i < n: fp16 widened to float, a vector at a time with F16C where the build
// has AVX2 (the loops below would convert one value at a time).
inline void widen(const at::Half* r, int64_t n, float* f) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + Avx2F::kLanes <= n; i += Avx2F::kLanes) Avx2F::store(f + i, Avx2F::load(r + i));
#endif
  for (; i < n; ++i) f[i] = static_cast<float>(r[i]);
}

// body(row, head stride) on row's kv heads as the loops read them: an fp16 row widened into
// `wide` (kv heads D apart), any other as it is.
template <typename cache_t, class Body>
inline void read_row(const cache_t* row, int64_t Hkv, int64_t D, int64_t head_stride,
                     std::vector<float>& wide, const Body& body) {
  if constexpr (std::is_same_v<cache_t, at::Half>) {
    for (int64_t h = 0; h < Hkv; ++h) widen(row + h * head_stride, D, wide.data() + h * D);
    body(static_cast<const float*>(wide.data()), D);
  } else {
    body(row, head_stride);
  }
}

struct Scratch {  // one thread's buffers
  std::vector<float> qf, scores, acc, wide;
};

template <typename scalar_t, typename cache_t>
// One sequence: q [H, D] (head stride q_sh), K/V rows at k, v (row_stride apart, kv heads
// head_stride apart), n rows; query head h reads kv head h / group. out [H, D] (head stride o_sh).
void attend_one(const scalar_t* q, int64_t q_sh, const cache_t* k, const cache_t* v,
                int64_t row_stride, int64_t head_stride, const Scales& sc, int64_t group,
                int64_t n, int64_t H, int64_t D, float scale, float softcap, scalar_t* out,
                int64_t o_sh, Scratch& s) {
  const int64_t Hkv = H / group;
  s.qf.assign(H * D, 0.f);
  s.acc.assign(H * D, 0.f);
  s.scores.resize(H * n);
  s.wide.resize(Hkv * D);
  float* scores = s.scores.data();
  for (int64_t g = 0; g < H; ++g)
    for (int64_t d = 0; d < D; ++d) s.qf[g * D + d] = static_cast<float>(q[g * q_sh + d]) * scale;
  std::vector<float> mx(H, -std::numeric_limits<float>::infinity()), inv(H);
  for (int64_t t = 0; t < n; ++t) {  // pass 1: q . k for every token, each K row read once
    read_row(k + t * row_stride, Hkv, D, head_stride, s.wide, [&](const auto* row, int64_t hs) {
      for (int64_t g = 0; g < H; ++g) {
        const float* qg = s.qf.data() + g * D;
        const auto* kr = row + (g / group) * hs;
        const at::Half* ks = sc.at(sc.k, t, g / group);
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * load(kr, ks, d);
        if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);  // s = cap * tanh(s / cap)
        scores[g * n + t] = dot;
        mx[g] = std::max(mx[g], dot);
      }
    });
  }
  for (int64_t g = 0; g < H; ++g) {  // softmax numerators and 1 / denominator
    float sum = 0.f;
    float* sg = scores + g * n;
    for (int64_t t = 0; t < n; ++t) sum += (sg[t] = std::exp(sg[t] - mx[g]));
    inv[g] = 1.f / sum;
  }
  for (int64_t t = 0; t < n; ++t) {  // pass 2: p . v, each V row read once
    read_row(v + t * row_stride, Hkv, D, head_stride, s.wide, [&](const auto* row, int64_t hs) {
      for (int64_t g = 0; g < H; ++g) {
        const auto* vr = row + (g / group) * hs;
        const at::Half* vs = sc.at(sc.v, t, g / group);
        const float p = scores[g * n + t];
        float* a = s.acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * load(vr, vs, d);
      }
    });
  }
  for (int64_t g = 0; g < H; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * o_sh + d] = static_cast<scalar_t>(s.acc[g * D + d] * inv[g]);
}

template <typename scalar_t, typename cache_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const Scales& sc, const int32_t* st, const int32_t* ln, double scale, int64_t window,
         double softcap, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), group = H / k_cache.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  pipellm::attention::for_each_sequence<Scratch>(ln, B, window, [&](int64_t b, Scratch& s) {
    const int64_t n = pipellm::attention::rows_read(ln, b, window);
    const int64_t first = st[b] + ln[b] - n;  // rows out of the window skipped
    Scales seq = sc;  // this sequence's scales start at its first row
    if (seq.k) {
      seq.k += first * sc.row_stride;
      seq.v += first * sc.row_stride;
    }
    attend_one<scalar_t, cache_t>(qp + b * q.stride(0), q.stride(1),
                                  kp + first * k_cache.stride(0), vp + first * k_cache.stride(0),
                                  k_cache.stride(0), k_cache.stride(1), seq, group, n, H, D,
                                  static_cast<float>(scale), static_cast<float>(softcap),
                                  op + b * out.stride(0), out.stride(1), s);
  });
}

// The vectorized variant for head_dim D at the chosen ISA level, with its name, or nullptr
// ("") for the generic code: D a multiple of the level's vector (or AVX2's: an AVX-512 CPU
// runs both) up to kMaxHeadDim; INT8 caches always take the generic code.
using Variant = void (*)(const pipellm::attention::Args&);
std::pair<Variant, const char*> variant(int64_t D, bool int8) {
  if (int8 || D <= 0 || D > pipellm::attention::kMaxHeadDim) return {nullptr, ""};
  const std::string level = vector_isa();
  if (level == "avx512" && D % 16 == 0) return {pipellm::attention::run_avx512, "avx512"};
  if ((level == "avx512" || level == "avx2") && D % 8 == 0)
    return {pipellm::attention::run_avx2, "avx2"};
  return {nullptr, ""};
}

pipellm::attention::DType dtype_of(at::ScalarType t) {
  using pipellm::attention::DType;
  return t == at::kFloat ? DType::kFloat : t == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
}

}  // namespace

// The vectorized variant a float cache's head of head_dim takes at the chosen ISA level
// ("avx512", "avx2"), or "" where the generic code runs it.
std::string decode_attention_variant(int64_t head_dim) { return variant(head_dim, false).second; }

// k_scale, v_scale (INT8 caches): fp16 [capacity, Hkv, D / 8], the caches int8. window: 0 for
// full attention, else the sliding window; softcap: 0 for none, else the logit soft-cap (see the
// top of this file).
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor seq_starts, at::Tensor seq_lens, double scale,
                               c10::optional<at::Tensor> k_scale,
                               c10::optional<at::Tensor> v_scale, int64_t window,
                               double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "K and V caches must share a layout");
  TORCH_CHECK(seq_starts.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "seq_starts and seq_lens must be int32");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(H % Hkv == 0 && k_cache.size(2) == D, "head counts or head_dim do not match");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  const bool int8 = k_scale.has_value();
  Scales sc;
  if (int8) {
    TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_scale.has_value() && D % kGroup == 0,
                "INT8 caches need int8 values, both scales and head_dim a multiple of 8");
    const auto& ks = *k_scale;
    const auto& vs = *v_scale;
    TORCH_CHECK(ks.scalar_type() == at::kHalf && ks.strides() == vs.strides() &&
                ks.stride(2) == 1 && ks.size(2) == D / kGroup, "bad INT8 scales");
    sc = Scales{ks.data_ptr<at::Half>(), vs.data_ptr<at::Half>(), ks.stride(0), ks.stride(1)};
  }
  auto starts = seq_starts.contiguous(), lens = seq_lens.contiguous();
  const int32_t* st = starts.data_ptr<int32_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  const bool half = !int8 && k_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat;
  TORCH_CHECK(int8 || half || k_cache.scalar_type() == q.scalar_type(),
              "caches must be q's dtype, fp16 under float32 queries, or int8 with scales");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches of one dtype");
  if (const Variant run = variant(D, int8).first) {
    TORCH_CHECK(k_cache.stride(1) == D, "kv heads must be contiguous within a cache row");
    auto out = at::empty(q.sizes(), q.options());
    run({q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
         k_cache.stride(0), st, ln, q.size(0), H, Hkv, D, static_cast<float>(scale),
         static_cast<float>(softcap), window, out.data_ptr(), dtype_of(q.scalar_type()),
         dtype_of(k_cache.scalar_type())});
    return out;
  }
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
    auto go = [&](auto cache_tag) {
      run<scalar_t, decltype(cache_tag)>(q, k_cache, v_cache, sc, st, ln, scale, window, softcap,
                                         out);
    };
    if (int8) go(int8_t{});
    else if (half) go(at::Half{});
    else go(scalar_t{});
  });
  return out;
}
