// The segmented LoRA delta's interface between lora.cpp (tensor checks, the choice of ISA) and
// its vectorized variants (lora_<isa>.cpp, each the template of lora_kernel.h compiled for one
// instruction set). Raw pointers only. Contract: pipellm/kernels/lora.py's lora_delta_.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

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
  float* h;  // [n, R] float32 scratch: x[rows] @ a[slot] (the AVX variants'; AMX keeps its own)
};

// (group, first index into rows, rows in the block) of every block of `size` rows of a group
inline std::vector<std::array<int64_t, 3>> row_blocks(const Args& a, int64_t size) {
  std::vector<std::array<int64_t, 3>> blocks;
  for (int64_t g = 0; g < a.G; ++g)
    for (int64_t i = a.starts[g]; i < a.starts[g + 1]; i += size)
      blocks.push_back({g, i, std::min(size, a.starts[g + 1] - i)});
  return blocks;
}

// The rows [k0, k1) of b that columns [o0, o1) read: those of the parts they are in.
inline std::pair<int64_t, int64_t> part_rows(const Args& a, int64_t o0, int64_t o1) {
  const int64_t rp = a.R / a.P;
  int64_t first = 0;
  while (a.part_ends[first] <= o0) ++first;
  int64_t last = first;
  while (a.part_ends[last] < o1) ++last;
  return {first * rp, (last + 1) * rp};
}

// R / P and out multiples of 16 (both ISAs' vectors divide them).
void run_avx2(const Args& args);
void run_avx512(const Args& args);
// AMX tiles (lora_amx.cpp): x, a and b bf16, `in` a multiple of 32, a and b also given packed
// in pairs of rows (a_vnni [S, in / 2, R, 2], b_vnni [S, R / 2, out, 2]); only where
// amx_ready(): the CPU has AMX-BF16 and Linux gave this process its tile state.
void run_amx(const Args& args, const void* a_vnni, const void* b_vnni);
bool amx_ready();

}  // namespace pipellm::lora
