// The block GEMMs' interface between block_gemm.cpp (tensor checks, the activations' INT8
// quantization, the choice of ISA) and its per-ISA kernels (block_gemm_<isa>.cpp, each the
// template of block_gemm_kernel.h compiled for one instruction set). Raw pointers only: the
// kernels' translation units include no torch headers. Layouts: block_gemm.cpp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace pipellm::block_gemm {

constexpr int64_t kBlock = 32, kTile = 16;

enum class OutType { kFloat, kBFloat16, kHalf };

struct Args {
  // activations x [M, K] quantized per row and block of 32: values [M, K], scale dx and
  // dx * sum(values) per block [M, K / 32]
  const int8_t* xq;
  const float* xd;
  const float* xs;
  int64_t M, K, N;
  // the packed weight: Q8 when `q8` (corr: 128 * each block's weight sum), else Q4 (m: mins)
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
  const float* corr;
  bool q8;
  const float* bias;  // [N] or null
  void* out;          // [M, N] of out_type
  OutType out_type;
  int64_t prefetch = 0;  // bytes of weights the streaming pass prefetches ahead (0: none)
};

// One per ISA level (pipellm/kernels/cpu/isa.py's names); each may run only on a CPU that has it.
void run_avx2(const Args& args);
void run_avx2_vnni(const Args& args);
void run_avx512(const Args& args);
void run_avx512_vnni(const Args& args);

}  // namespace pipellm::block_gemm
