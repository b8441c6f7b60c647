// The decode attention's interface between decode_attention.cpp (tensor checks, the generic
// path, the choice of ISA) and its vectorized variants (decode_attention_<isa>.cpp, each the
// template of decode_attention_kernel.h compiled for one instruction set). Raw pointers only.
// The variants cover float caches of q's dtype, or fp16 caches under float32 queries, with
// head_dim a multiple of their vector's floats up to kMaxHeadDim; INT8 caches and other head
// sizes take the generic path.
#pragma once

#include <cstdint>

namespace pipellm::attention {

enum class DType { kFloat, kBFloat16, kHalf };

struct Args {
  const void* q;  // [B, H, D]: sequence b's head h at q + b * q_sb + h * q_sh (elements)
  int64_t q_sb, q_sh;
  const void* k;  // caches [capacity, Hkv, D]: row t's kv head h at t * row_stride + h * D
  const void* v;
  int64_t row_stride;
  const int32_t* starts;  // [B]: sequence b owns rows [starts[b], starts[b] + lens[b])
  const int32_t* lens;
  int64_t B, H, Hkv, D;
  float scale, softcap;  // softcap 0: none
  int64_t window;        // 0: full attention
  void* out;             // [B, H, D] contiguous
  DType dtype;           // of q and out
  DType cache;           // of the caches: dtype, or kHalf under kFloat
};

constexpr int64_t kMaxHeadDim = 256;

// One per ISA level that has a variant; each may run only on a CPU that has it.
void run_avx2(const Args& args);
void run_avx512(const Args& args);

}  // namespace pipellm::attention
