// A decode step's decoder layers in one call: pipellm/services/compute/model/llama.py's layer loop for
// a plain Llama-family model (RMSNorms, fused qkv with RoPE and optional q/k norms, SiLU-gated
// MLP; INT4 block projections), the same kernels in the same order, without a return to Python
// between them.
#pragma once

#include "ops.h"

// An INT4 projection: pipellm/kernels/int4_cpu.py's Int4Blocks (scales d, mins m, n outputs) and bias.
struct Int4Projection {
  Tensor qs, d, m;
  int64_t n;
  std::optional<Tensor> bias;
  Tensor operator()(const Tensor& x) const { return q4_gemm(x, qs, d, m, n, bias); }
};

struct DecodeLayer {
  Tensor ln_attn, ln_mlp;  // [hidden], the input norms of the attention and the MLP
  Tensor cos, sin;         // the layer's RoPE tables [max_pos, D / 2]
  Int4Projection qkv, o, gate_up, down;
  int64_t window;                        // 0: full attention
  std::optional<Tensor> q_norm, k_norm;  // [D]: each q and k head normed before RoPE (Qwen3)
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
              double softcap);
  void add_layer(DecodeLayer layer);
  // h: the step's embeddings [T, hidden], every row a decode; k, v: the caches [L, capacity,
  // Hkv, D] (k_scale, v_scale: INT8's). Returns (h, residual) after the last layer's MLP.
  std::tuple<Tensor, Tensor> run(Tensor h, Tensor positions, Tensor slots, Tensor starts,
                                 Tensor lens, Tensor k, Tensor v, std::optional<Tensor> k_scale,
                                 std::optional<Tensor> v_scale) const;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_, softcap_;
  std::vector<DecodeLayer> layers_;
};

std::tuple<Tensor, Tensor> decode_layers(const DecodeStack& stack, Tensor h, Tensor positions,
                                         Tensor slots, Tensor starts, Tensor lens, Tensor k,
                                         Tensor v, std::optional<Tensor> k_scale,
                                         std::optional<Tensor> v_scale);
