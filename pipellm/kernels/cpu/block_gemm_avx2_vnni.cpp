// The block GEMMs for AVX2 with AVX-VNNI: a block's byte dot products in the 256-bit VEX
// vpdpbusd (block_gemm_kernel.h, block_gemm_avx2.h).
#include "block_gemm_isa.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avxvnni")
#include "block_gemm_avx2.h"
#include "block_gemm_kernel.h"

void pipellm::block_gemm::run_avx2_vnni(const Args& args) { run_isa<Avx2<true>>(args); }
PIPELLM_TARGET_END
#else
void pipellm::block_gemm::run_avx2_vnni(const Args&) {
  throw std::runtime_error("not an x86 build");
}
#endif
