// The prefill attention's CPU kernels and what their binding (prefill_attention.cpp) hands them:
// the contract of kernels/prefill_attention.py's prefill_attention_reference without a softcap or
// INT8 scales. Raw pointers only: the kernels' translation units include no torch headers.
//   run_amx     bf16 on AMX tiles, head_dim a multiple of 64, no window (prefill_attention_amx.cpp)
//   run_avx512  float32 vectors of 16 over float, bf16 or half inputs, head_dim a multiple of 16
//   run_avx2    the same, vectors of 8 (prefill_attention_<isa>.cpp: prefill_attention_kernel.h)
#pragma once

#include <cstdint>

namespace pipellm::prefill {

enum class DType { kFloat, kBFloat16, kHalf };

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
  DType dtype;     // of q, the caches and out
  int64_t window;  // > 0: the query at position p sees keys (p - window, p] only; 0: none
};

void run_amx(const Args& args);
void run_avx2(const Args& args);
void run_avx512(const Args& args);

}  // namespace pipellm::prefill
