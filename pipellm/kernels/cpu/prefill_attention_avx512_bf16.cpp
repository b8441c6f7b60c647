// The prefill attention for AVX-512 with AVX512-BF16 on bf16 caches of bf16 queries, P rounded
// to bf16 (a pooling forward's coarse_p): both products as bf16 pairs summed in float32
// (VDPBF16PS; prefill_attention_kernel.h, kPairs).
#include "prefill_attention.h"
#include "isa_target.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include "simd_avx512.h"
#include "prefill_attention_schedule.h"
#include "prefill_attention_kernel.h"

void pipellm::prefill::run_avx512_bf16(const Args& args) {
  if (args.dtype != DType::kBFloat16 || args.cache != Cache::kSame)
    throw std::runtime_error("run_avx512_bf16: bf16 queries and caches only");
  VecAttention<Avx512F, c10::BFloat16, true>{args}.run();
}
PIPELLM_TARGET_END
#else
void pipellm::prefill::run_avx512_bf16(const Args&) {
  throw std::runtime_error("not an x86 build");
}
#endif
