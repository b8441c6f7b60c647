// The prefill attention for AVX2 + FMA: 8 floats a vector (prefill_attention_kernel.h).
#include "prefill_attention.h"
#include "isa_target.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c")
#include "simd_avx2.h"
#include "prefill_attention_schedule.h"
#include "prefill_attention_kernel.h"

void pipellm::prefill::run_avx2(const Args& args) { run_isa<Avx2F>(args); }
PIPELLM_TARGET_END
#else
void pipellm::prefill::run_avx2(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
