// The segmented LoRA delta for AVX2 + FMA + F16C: 8 floats a vector (lora_kernel.h).
#include "lora.h"
#include "isa_target.h"

#include <array>
#include <type_traits>

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c")
#include "simd_avx2.h"
#include "lora_kernel.h"

void pipellm::lora::run_avx2(const Args& args) { run_isa<Avx2F>(args); }
PIPELLM_TARGET_END
#else
void pipellm::lora::run_avx2(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
