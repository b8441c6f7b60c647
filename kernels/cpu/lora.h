// The segmented LoRA delta's interface between lora.cpp (tensor checks, the choice of ISA) and
// its vectorized variants (lora_<isa>.cpp, each the template of lora_kernel.h compiled for one
// instruction set). Raw pointers only. Contract: kernels/lora.py's lora_delta_.
#pragma once

#include <cstdint>

namespace pipellm::lora {

enum class DType { kFloat, kBFloat16, kHalf };

struct Args {
  void* y;        // [T, out], row stride y_rs (elements), dtype y_dtype
  const void* x;  // [T, in], row stride x_rs, dtype x_dtype (a's and b's too)
  const void* a;  // [S, in, R] contiguous
  const void* b;  // [S, R, out] contiguous
  const int64_t* rows;    // [n]: group g is rows[starts[g] .. starts[g + 1])
  const int64_t* starts;  // [G + 1]
  const int64_t* slots;   // [G]: the group's adapter, an index into a and b
  const int64_t* part_ends;  // [P]: b is block-diagonal, part j holding out columns
                             // part_ends[j - 1] .. part_ends[j] and rows j R/P .. (j + 1) R/P
  int64_t P, y_rs, x_rs, in, R, out, G;
  DType y_dtype, x_dtype;
  float* h;  // [n, R] float32 scratch: x[rows] @ a[slot]
};

// R / P and out multiples of 16 (both ISAs' vectors divide them).
void run_avx2(const Args& args);
void run_avx512(const Args& args);
// AMX tiles (lora_amx.cpp): x, a and b bf16, `in` a multiple of 32, a and b also given packed
// in pairs of rows (a_vnni [S, in / 2, R, 2], b_vnni [S, R / 2, out, 2]); only where
// amx_ready(): the CPU has AMX-BF16 and Linux gave this process its tile state.
void run_amx(const Args& args, const void* a_vnni, const void* b_vnni);
bool amx_ready();

}  // namespace pipellm::lora
