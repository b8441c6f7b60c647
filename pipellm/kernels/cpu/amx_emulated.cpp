// The module of pipellm/kernels/cpu/emulated.py: the AMX kernels built from their own sources with
// PIPELLM_AMX_EMULATE (tiles emulated: amx_emulate.h), bound as the main module binds them,
// at the one level they run at (AVX-512 vectors beside the tiles).
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

using at::Tensor;

std::string vector_isa() { return "avx512"; }  // what block_gemm.cpp's says at an AMX level

// lora.cpp
void lora_delta(Tensor y, Tensor x, Tensor a, Tensor b, Tensor rows, Tensor starts,
                Tensor slots, std::vector<int64_t> part_ends, std::optional<Tensor> a_vnni,
                std::optional<Tensor> b_vnni);
// prefill_attention.cpp
Tensor prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_q_lens,
                         Tensor seq_starts, Tensor ctx_lens, double scale, int64_t window,
                         std::optional<Tensor> k_scale, std::optional<Tensor> v_scale,
                         bool coarse_p);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_delta", &lora_delta,
        "lora_delta's AMX variant on emulated tiles (bf16 x, a and b given packed too)",
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("rows"),
        py::arg("starts"), py::arg("slots"), py::arg("part_ends"),
        py::arg("a_vnni") = py::none(), py::arg("b_vnni") = py::none());
  m.def("prefill_attention", &prefill_attention,
        "prefill_attention's AMX kernel on emulated tiles (bf16, head_dim a multiple of 64)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cu_q_lens"),
        py::arg("seq_starts"), py::arg("ctx_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("coarse_p") = false);
}
