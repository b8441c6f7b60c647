// The block GEMMs for AVX2 + FMA + F16C (block_gemm_kernel.h, block_gemm_avx2.h): 8 rows a
// vector, byte dot products with vpmaddubsw / vpmaddwd.
#include "block_gemm_isa.h"

#ifdef PIPELLM_X86
PIPELLM_TARGET_BEGIN("avx,avx2,fma,f16c")
#include "block_gemm_avx2.h"
#include "block_gemm_kernel.h"

void pipellm::block_gemm::run_avx2(const Args& args) { run_isa<Avx2<false>>(args); }
PIPELLM_TARGET_END
#else
void pipellm::block_gemm::run_avx2(const Args&) { throw std::runtime_error("not an x86 build"); }
#endif
