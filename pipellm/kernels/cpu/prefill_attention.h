// The prefill attention's CPU kernels and what their binding (prefill_attention.cpp) hands them:
// the contract of pipellm/kernels/prefill_attention.py's prefill_attention_reference without a softcap.
// Raw pointers only: the kernels' translation units include no torch headers.
//   run_amx     bf16 on AMX tiles, head_dim a multiple of 64, no window, caches of q's dtype
//               (prefill_attention_amx.cpp)
//   run_avx512  float32 vectors of 16 over float, bf16 or half queries, head_dim a multiple of
//               16, caches of q's dtype, INT8 with scales or FP8 (pipellm/kernels/kv_quant.py), or fp16
//               under float32 queries
//   run_avx2    the same, vectors of 8 (prefill_attention_<isa>.cpp: prefill_attention_kernel.h)
//   run_avx512_bf16  bf16 queries and caches with coarse_p in vectors of 16 at the AVX-512
//               levels, on a CPU with AVX512-BF16: products of bf16 pairs, float32 sums
//               (prefill_attention_avx512_bf16.cpp)
#pragma once

#include <cstdint>

namespace pipellm::prefill {

enum class DType { kFloat, kBFloat16, kHalf };
// the caches' elements: q's dtype, INT8, e4m3, or fp16 under float32 queries
enum class Cache { kSame, kInt8, kFp8, kHalf };
constexpr int64_t kKvGroup = 8;  // INT8 caches: one fp16 scale per 8 values (pipellm/kernels/kv_quant.py)

struct Args {
  const void* q;  // [T, H, D]: rows q_ts apart, heads q_hs apart (elements)
  const void* k;  // [capacity, Hkv, D]: rows k_ts apart, heads k_hs apart
  const void* v;  // same shape as k: rows v_ts apart, heads v_hs apart
  void* out;      // [T, H, D] contiguous
  const int32_t* cu;      // [S + 1]: sequence s's queries are q[cu[s] .. cu[s + 1])
  const int32_t* starts;  // [S]: its key 0's row in the caches
  const int32_t* lens;    // [S]: its keys (its queries are the last cu[s + 1] - cu[s])
  int64_t S, H, Hkv, D, q_ts, q_hs, k_ts, k_hs, v_ts, v_hs;
  float scale;
  DType dtype;     // of q and out (and the caches under Cache::kSame)
  int64_t window;  // > 0: the query at position p sees keys (p - window, p] only; 0: none
  Cache cache;
  // INT8 caches: fp16 scales [capacity, Hkv, D / 8] (value = int8 * scale), rows ks_ts / vs_ts
  // apart, heads ks_hs / vs_hs apart; null otherwise
  const void* k_scale;
  const void* v_scale;
  int64_t ks_ts, ks_hs, vs_ts, vs_hs;
  // P (the softmax's numerators) rounded to bf16 alone, as FlashAttention keeps it (pooling's
  // choice): run_amx then runs one P V product where it otherwise runs two (~16 bits of P),
  // and bf16 runs as run_avx512_bf16's bf16 products where the CPU has them; the float32
  // kernels keep P in float32
  bool coarse_p;
};

void run_amx(const Args& args);
void run_avx2(const Args& args);
void run_avx512(const Args& args);
void run_avx512_bf16(const Args& args);

}  // namespace pipellm::prefill
