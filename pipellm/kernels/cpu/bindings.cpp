// The one Python module of the C++ CPU kernels (pipellm/kernels/cpu/__init__.py builds it from all
// the sources): each function is defined in the .cpp of its concept, declared in ops.h, bound here.
// torch's pybind11 with its Tensor and std type casters: what <torch/extension.h> includes for
// a module, without the C++ frontend it adds (half of this file's compile).
#include <torch/csrc/utils/pybind.h>

#include "decode_layers.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // a kernel runs without the GIL, as torch's own ops do: the process's other threads (its
  // heartbeat, a grammar compile) go on while it computes; arguments are converted first
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, "decode attention over contiguous KV segments",
        nogil, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("seq_starts"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("decode_attention_variant", &decode_attention_variant,
        "the vectorized variant (avx512, avx2) a float cache's head of head_dim takes, or ''",
        nogil, py::arg("head_dim"));
  m.def("rms_norm", &rms_norm, "w * rmsnorm(x) -> [..., N]", nogil, py::arg("x"), py::arg("w"),
        py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x)", nogil,
        py::arg("x"), py::arg("residual"), py::arg("w"), py::arg("eps"));
  m.def("rms_norm_int8", &rms_norm_int8,
        "(int8 [T, N], scales [T], residual + x or None): quantize_int8(rms_norm(...))", nogil,
        py::arg("x"), py::arg("residual"), py::arg("w"), py::arg("eps"));
  m.def("lora_delta", &lora_delta,
        "in place: y[rows of group g] += (x[those rows] @ a[slots[g]]) @ b[slots[g]]", nogil,
        py::arg("y"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("rows"),
        py::arg("starts"), py::arg("slots"), py::arg("part_ends"),
        py::arg("a_vnni") = py::none(), py::arg("b_vnni") = py::none());
  m.def("prefill_attention_amx_ready", &prefill_attention_amx_ready,
        "whether prefill_attention runs bf16 on AMX tiles here (tiles this process may use)",
        nogil);
  m.def("prefill_attention", &prefill_attention,
        "causal attention of each sequence's last queries over its keys (float32 vectors, or "
        "bf16 on AMX tiles)", nogil,
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cu_q_lens"),
        py::arg("seq_starts"), py::arg("ctx_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("coarse_p") = false);
  m.def("silu_mul", &silu_mul, "silu(gate) * up: [..., 2I] -> [..., I]", nogil, py::arg("gate_up"));
  m.def("quantize_int8", &quantize_int8, "per-token INT8: (int8 [T, K], scales [T])", nogil,
        py::arg("x"));
  m.def("silu_mul_int8", &silu_mul_int8, "quantize_int8(silu(gate) * up) as [T, I] rows", nogil,
        py::arg("gate_up"));
  m.def("rope_kv_write", &rope_kv_write,
        "(q_rot, k_rot); writes k_rot and v at the caches' slots", nogil, py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("positions"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits [S, V] of the listed rows to -inf where their bitmask bit is 0, in place", nogil,
        py::arg("logits"), py::arg("bitmask"), py::arg("rows"));
  m.def("set_block_gemm_isa", &set_block_gemm_isa,
        "the ISA level whose block GEMM kernels run (pipellm/kernels/cpu/isa.py; \"\": none)", nogil,
        py::arg("level"));
  m.def("block_gemm_isa", &block_gemm_isa, "the level the block GEMMs run (\"\": none)", nogil);
  m.def("set_block_gemm_prefetch", &set_block_gemm_prefetch,
        "bytes ahead the weights' streaming pass prefetches (-1: the level's own; 0: none)",
        nogil, py::arg("bytes"));
  m.def("q4_gemm", &q4_gemm, "INT4 blocks x INT8 activations: [M, K] -> [M, n]", nogil,
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("q8_gemm", &q8_gemm, "INT8 blocks x INT8 activations: [M, K] -> [M, n]", nogil,
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("corr"), py::arg("n"),
        py::arg("bias") = py::none());
  m.def("q8_gemm_int8_rows", &q8_gemm_int8_rows,
        "INT8 blocks x INT8 activations quantized per row (W8A8): [M, K] -> float32 [M, n]", nogil,
        py::arg("xq"), py::arg("x_scale"), py::arg("qs"), py::arg("d"), py::arg("corr"),
        py::arg("n"));
  m.def("sample_rows", &sample_rows,
        "(ids [B] int64, logprobs [B] f32): pipellm/kernels/sampling.py's sample_reference per row", nogil,
        py::arg("logits"), py::arg("raw_logits"), py::arg("temperature"), py::arg("top_p"),
        py::arg("min_p"), py::arg("top_k"), py::arg("seeds"), py::arg("steps"),
        py::arg("need_logprobs"));
  py::class_<Int4Projection>(m, "Int4Projection", "an INT4 projection (decode_layers.h)")
      .def(py::init([](Tensor qs, Tensor d, Tensor m, int64_t n, std::optional<Tensor> bias) {
             return Int4Projection{qs, d, m, n, bias};
           }),
           py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("n"), py::arg("bias") = py::none());
  py::class_<DecodeStack>(m, "DecodeStack", "a decode step's layers in one call")
      .def(py::init<int64_t, int64_t, int64_t, double, double, double>(), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("softcap"))
      .def("add_layer",
           [](DecodeStack& s, Tensor ln_attn, Tensor ln_mlp, Tensor cos, Tensor sin,
              Int4Projection qkv, Int4Projection o, Int4Projection gate_up, Int4Projection down,
              int64_t window, std::optional<Tensor> q_norm, std::optional<Tensor> k_norm) {
             s.add_layer(DecodeLayer{ln_attn, ln_mlp, cos, sin, qkv, o, gate_up, down, window,
                                     q_norm, k_norm});
           },
           py::arg("ln_attn"), py::arg("ln_mlp"), py::arg("cos"), py::arg("sin"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("window"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none());
  m.def("decode_layers", &decode_layers,
        "(h, residual) after a decode step's last layer (DecodeStack.run)", nogil,
        py::arg("stack"), py::arg("h"), py::arg("positions"), py::arg("slots"),
        py::arg("starts"), py::arg("lens"), py::arg("k"), py::arg("v"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
}
