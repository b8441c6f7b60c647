// A token bitmask applied to logits: the CPU twin of xgrammar's CUDA kernel (reference:
// pipellm/kernels/token_bitmask.py's apply_token_bitmask_ref).
//
// logits float32 [S, V] (rows contiguous), bitmask int32 [S, ceil(V / 32)] (bit j of word w:
// token 32w + j is allowed), rows int64 [R]: for each listed row, every token whose bit is 0
// is set to -inf, in place. Whole words of 0 (most of a grammar's vocabulary) and of ~0 take
// the fast paths. Rows go in parallel.
#include <ATen/Parallel.h>
#include "tensor.h"

#include <algorithm>
#include <limits>

void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [S, V] with contiguous rows");
  const int64_t V = logits.size(1), words = (V + 31) / 32;
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous()
              && bitmask.size(0) == logits.size(0) && bitmask.size(1) >= words,
              "bitmask must be int32 [S, ceil(V / 32)], contiguous");
  const auto idx = rows.to(at::kLong).contiguous();
  const int64_t* r = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < logits.size(0), "bad row");
  float* base = logits.data_ptr<float>();
  const int32_t* bits = bitmask.data_ptr<int32_t>();
  const int64_t ls = logits.stride(0), bs = bitmask.size(1);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + r[i] * ls;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(bits + r[i] * bs);
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t m = mask[w];
        const int64_t t0 = 32 * w, t1 = std::min<int64_t>(t0 + 32, V);
        if (m == 0xFFFFFFFFu) continue;
        if (m == 0) {
          std::fill(row + t0, row + t1, kNegInf);
          continue;
        }
        for (int64_t t = t0; t < t1; ++t)
          if (!((m >> (t - t0)) & 1u)) row[t] = kNegInf;
      }
    }
  });
}
