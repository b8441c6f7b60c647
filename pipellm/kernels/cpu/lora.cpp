// The segmented LoRA delta on the CPU: the CPU twin of pipellm/kernels/lora.py's Triton kernels (same
// contract as its lora_delta_, lora_delta_reference its reference), in place on y:
//   for each group g: y[rows[starts[g] .. starts[g + 1])] += (x[those rows] @ a[slots[g]]) @ b[slots[g]]
// y [T, out] float32 / bf16 / fp16; x [T, in] and a [S, in, R], b [S, R, out] in one dtype of
// those; rows, starts, slots int64; part_ends: where b is block-diagonal, the ends of its
// column blocks (pipellm/kernels/lora.py). Runs the vectorized variant of the level the block GEMMs
// run (set_block_gemm_isa: avx2 or an avx512 level), which needs R and out multiples of 16;
// given a and b packed too (a_vnni, b_vnni: pipellm/kernels/lora.py's cpu_packed, which gives them at
// the amx level), bf16 x and a CPU whose AMX tiles this process may use, AMX (lora_amx.cpp).
// pipellm/kernels/lora.py sends other calls to the reference. Built with PIPELLM_AMX_EMULATE
// (pipellm/kernels/cpu/emulated.py), it runs the AMX variant's cases alone, on emulated tiles.
#include "tensor.h"

#include <optional>
#include <string>
#include <vector>

#include "lora.h"

std::string vector_isa();  // block_gemm.cpp: avx512, avx2 or "" at the chosen level

namespace {

pipellm::lora::DType dtype_of(at::ScalarType t) {
  using pipellm::lora::DType;
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
              "lora_delta: float32, bfloat16 or float16 only");
  return t == at::kFloat ? DType::kFloat : t == at::kBFloat16 ? DType::kBFloat16 : DType::kHalf;
}

}  // namespace

void lora_delta(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b,
                at::Tensor rows, at::Tensor starts, at::Tensor slots,
                std::vector<int64_t> part_ends, std::optional<at::Tensor> a_vnni,
                std::optional<at::Tensor> b_vnni) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 3 && b.dim() == 3, "bad ranks");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "rows of y and x, and a and b, must be contiguous");
  const int64_t in = x.size(1), R = a.size(2), out = y.size(1), G = slots.size(0);
  TORCH_CHECK(a.size(1) == in && b.size(1) == R && b.size(2) == out && a.size(0) == b.size(0),
              "a [S, in, R] and b [S, R, out] do not fit x and y");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type(),
              "x, a and b must share a dtype");
  const int64_t P = static_cast<int64_t>(part_ends.size());
  TORCH_CHECK(P >= 1 && R % (16 * P) == 0 && out % 16 == 0 && part_ends.back() == out,
              "R / parts and out must be multiples of 16, the last part ending at out");
  for (int64_t j = 0; j < P; ++j)
    TORCH_CHECK(part_ends[j] > (j ? part_ends[j - 1] : 0), "part_ends must increase");
  TORCH_CHECK(rows.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
              slots.scalar_type() == at::kLong && rows.is_contiguous() &&
              starts.is_contiguous() && slots.is_contiguous() && starts.size(0) == G + 1,
              "rows, starts [G + 1] and slots [G] must be contiguous int64");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* gp = slots.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[G] == rows.size(0), "starts must run from 0 to rows' length");
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(sp[g] <= sp[g + 1] && 0 <= gp[g] && gp[g] < a.size(0), "bad starts or slots");
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(0 <= rp[i] && rp[i] < x.size(0) && rp[i] < y.size(0), "a row out of range");
  const std::string level = vector_isa();
  const bool avx512 = level == "avx512";
  TORCH_CHECK(avx512 || level == "avx2", "lora_delta: no vectorized level on this CPU");
  const bool amx = avx512 && a_vnni && b_vnni && x.scalar_type() == at::kBFloat16 &&
                   in % 32 == 0 && pipellm::lora::amx_ready();
  auto h = at::empty({amx ? 0 : rows.size(0), R}, x.options().dtype(at::kFloat));
  const pipellm::lora::Args args{
      y.data_ptr(), x.data_ptr(), a.data_ptr(), b.data_ptr(), rp, sp, gp, part_ends.data(), P,
      y.stride(0), x.stride(0), in, R,
      out, G, dtype_of(y.scalar_type()), dtype_of(x.scalar_type()), h.data_ptr<float>()};
  if (amx) {
    TORCH_CHECK(a_vnni->is_contiguous() && b_vnni->is_contiguous() &&
                a_vnni->numel() == a.numel() && b_vnni->numel() == b.numel() &&
                a_vnni->scalar_type() == at::kBFloat16 && b_vnni->scalar_type() == at::kBFloat16,
                "a_vnni and b_vnni must be a and b packed (pipellm/kernels/lora.py's vnni_pack)");
    return pipellm::lora::run_amx(args, a_vnni->data_ptr(), b_vnni->data_ptr());
  }
#ifdef PIPELLM_AMX_EMULATE
  TORCH_CHECK(false, "lora_delta: the emulated build runs the AMX variant's cases only");
#else
  (avx512 ? pipellm::lora::run_avx512 : pipellm::lora::run_avx2)(args);
#endif
}
