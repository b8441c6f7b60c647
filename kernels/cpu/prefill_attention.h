// The prefill attention's CPU kernel on AMX tiles (prefill_attention_amx.cpp), and what its
// binding (prefill_attention.cpp) hands it: the contract of kernels/prefill_attention.py's
// prefill_attention_reference for bfloat16 q and caches, no window, no softcap, head_dim a
// multiple of 64.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pipellm::prefill {

struct Args {
  const c10::BFloat16* q;  // [T, H, D]: rows q_ts apart, heads q_hs apart
  const c10::BFloat16* k;  // [capacity, Hkv, D]: rows k_ts apart, heads k_hs apart
  const c10::BFloat16* v;  // same shape as k: rows v_ts apart, heads v_hs apart
  c10::BFloat16* out;      // [T, H, D] contiguous
  const int32_t* cu;       // [S + 1]: sequence s's queries are q[cu[s] .. cu[s + 1])
  const int32_t* starts;   // [S]: its key 0's row in the caches
  const int32_t* lens;     // [S]: its keys (its queries are the last cu[s + 1] - cu[s])
  int64_t S, H, Hkv, D, q_ts, q_hs, k_ts, k_hs, v_ts, v_hs;
  float scale;
};

void run_amx(const Args& args);

}  // namespace pipellm::prefill
