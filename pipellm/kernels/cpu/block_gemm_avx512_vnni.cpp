// The block GEMMs for AVX-512 with VNNI: a block's byte dot products in vpdpbusd
// (block_gemm_kernel.h, block_gemm_avx512.h).
#include "block_gemm_isa.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "block_gemm_avx512.h"
#include "block_gemm_kernel.h"

void pipellm::block_gemm::run_avx512_vnni(const Args& args) { run_isa<Avx512<true>>(args); }
PIPELLM_TARGET_END
#else
void pipellm::block_gemm::run_avx512_vnni(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
