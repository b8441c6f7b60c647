// Prefill attention on the CPU (the kernels of prefill_attention.h): the contract of
// pipellm/kernels/prefill_attention.py's prefill_attention_reference without a softcap. q [T, H, D]
// (float32, bfloat16 or float16) and the caches [capacity, Hkv, D] (q's dtype; or int8 with fp16
// scales [capacity, Hkv, D / 8]; or float8_e4m3fn; or fp16 under float32 q) with unit stride
// along D, D a multiple of 16, H a multiple of Hkv; cu_q_lens [S + 1], seq_starts [S], ctx_lens
// [S] int32 (each sequence's queries are the last of its keys). bf16 caches with D a multiple
// of 64 and no window run on AMX tiles where this process may use them; other bf16 caches of
// bf16 queries with coarse_p as bf16 products at the AVX-512 levels on a CPU with AVX512-BF16;
// everything else in float32 vectors of the block GEMMs' ISA level (avx2, or avx512 for every
// AVX-512 level).
// pipellm/kernels/prefill_attention.py sends it only what it takes; anything else is a TORCH_CHECK
// error. Built with PIPELLM_AMX_EMULATE (pipellm/kernels/cpu/emulated.py), it runs the AMX kernel's
// cases alone, on emulated tiles.
#include "tensor.h"

#include "lora.h"
#include "prefill_attention.h"

std::string vector_isa();  // block_gemm.cpp: avx512, avx2 or "" at the chosen level

bool prefill_attention_amx_ready() {
  return vector_isa() == "avx512" && pipellm::lora::amx_ready();
}

namespace {

using pipellm::prefill::Cache;
using pipellm::prefill::DType;

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kHalf;
    default: TORCH_CHECK(false, "prefill_attention: q must be float32, bfloat16 or float16");
  }
}

// the kernel for these inputs at the chosen level
void (*kernel_for(DType dtype, Cache cache, int64_t D, int64_t window, bool coarse_p))(
    const pipellm::prefill::Args&) {
  if (dtype == DType::kBFloat16 && cache == Cache::kSame && D % 64 == 0 && window == 0 &&
      prefill_attention_amx_ready())
    return pipellm::prefill::run_amx;
#ifdef PIPELLM_AMX_EMULATE
  TORCH_CHECK(false, "prefill_attention: the emulated build runs the AMX kernel's cases only");
#else
  const std::string level = vector_isa();
  // bf16 products for a pooling forward (generation keeps float32 products: greedy answers
  // follow the sums' rounding order, bit for bit as before)
  if (dtype == DType::kBFloat16 && cache == Cache::kSame && coarse_p && level == "avx512" &&
      __builtin_cpu_supports("avx512bf16"))
    return pipellm::prefill::run_avx512_bf16;
  if (level == "avx512") return pipellm::prefill::run_avx512;
  if (level == "avx2") return pipellm::prefill::run_avx2;
  TORCH_CHECK(false, "prefill_attention: no kernel for this CPU (no ISA level chosen)");
#endif
}

// the caches' kind; INT8's scales checked ([capacity, Hkv, D / 8] fp16, unit stride along D)
Cache cache_of(const at::Tensor& q, const at::Tensor& k_cache,
               const std::optional<at::Tensor>& k_scale,
               const std::optional<at::Tensor>& v_scale) {
  const auto t = k_cache.scalar_type();
  if (t == at::kChar) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "INT8 caches need their scales");
    for (const auto& sc : {*k_scale, *v_scale})
      TORCH_CHECK(sc.scalar_type() == at::kHalf && sc.dim() == 3 && sc.stride(2) == 1 &&
                  sc.size(0) == k_cache.size(0) && sc.size(1) == k_cache.size(1) &&
                  sc.size(2) * pipellm::prefill::kKvGroup == k_cache.size(2),
                  "INT8 scales must be fp16 [capacity, Hkv, D / 8]");
    return Cache::kInt8;
  }
  TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "scales belong to INT8 caches");
  if (t == at::kFloat8_e4m3fn) return Cache::kFp8;
  if (t == at::kHalf && q.scalar_type() == at::kFloat) return Cache::kHalf;
  TORCH_CHECK(t == q.scalar_type(),
              "the caches must be q's dtype, int8, float8_e4m3fn or fp16 under float32 q");
  return Cache::kSame;
}

}  // namespace

at::Tensor prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                at::Tensor cu_q_lens, at::Tensor seq_starts,
                                at::Tensor ctx_lens, double scale, int64_t window,
                                std::optional<at::Tensor> k_scale,
                                std::optional<at::Tensor> v_scale, bool coarse_p) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == k_cache.scalar_type(),
              "q [T, H, D] and caches [capacity, Hkv, D] of one dtype");
  const Cache cache = cache_of(q, k_cache, k_scale, v_scale);
  for (const auto& t : {q, k_cache, v_cache})
    TORCH_CHECK(t.stride(2) == 1, "q and the caches must have unit stride along D");
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(1), S = seq_starts.size(0);
  TORCH_CHECK(D % 16 == 0 && k_cache.size(2) == D && H % Hkv == 0,
              "D must be a multiple of 16, shared by q and the caches; H a multiple of Hkv");
  for (const auto& t : {cu_q_lens, seq_starts, ctx_lens})
    TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), "int32 index tensors");
  TORCH_CHECK(cu_q_lens.size(0) == S + 1 && ctx_lens.size(0) == S, "S + 1 and S entries");
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* st = seq_starts.data_ptr<int32_t>();
  const int32_t* n = ctx_lens.data_ptr<int32_t>();
  TORCH_CHECK(S == 0 || (cu[0] == 0 && cu[S] == q.size(0)), "cu_q_lens must run 0 .. T");
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(0 <= cu[s + 1] - cu[s] && cu[s + 1] - cu[s] <= n[s] && st[s] >= 0 &&
                st[s] + n[s] <= k_cache.size(0), "a sequence's queries or keys out of range");
  const DType dtype = dtype_of(q.scalar_type());
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  const auto run = kernel_for(dtype, cache, D, window, coarse_p);
  auto out = at::empty({q.size(0), H, D}, q.options());
  const pipellm::prefill::Args args{
      q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), cu, st, n, S, H, Hkv,
      D, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
      v_cache.stride(1), static_cast<float>(scale), dtype, window, cache,
      k_scale ? k_scale->data_ptr() : nullptr, v_scale ? v_scale->data_ptr() : nullptr,
      k_scale ? k_scale->stride(0) : 0, k_scale ? k_scale->stride(1) : 0,
      v_scale ? v_scale->stride(0) : 0, v_scale ? v_scale->stride(1) : 0, coarse_p};
  run(args);
  return out;
}
