// The decode attention for AVX-512 F/BW/VL/DQ: 16 floats a vector (decode_attention_kernel.h).
#include "decode_attention.h"
#include "decode_attention_schedule.h"
#include "isa_target.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include "simd_avx512.h"
#include "decode_attention_kernel.h"

void pipellm::attention::run_avx512(const Args& args) { run_isa<Avx512F>(args); }
PIPELLM_TARGET_END
#else
void pipellm::attention::run_avx512(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
