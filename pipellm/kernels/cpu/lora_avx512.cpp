// The segmented LoRA delta for AVX-512 F/BW/VL/DQ: 16 floats a vector (lora_kernel.h).
#include "lora.h"
#include "isa_target.h"

#include <array>
#include <type_traits>

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include "simd_avx512.h"
#include "lora_kernel.h"

void pipellm::lora::run_avx512(const Args& args) { run_isa<Avx512F>(args); }
PIPELLM_TARGET_END
#else
void pipellm::lora::run_avx512(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
