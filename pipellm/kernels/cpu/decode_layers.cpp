// DecodeStack (decode_layers.h): each layer as llama.py runs it,
//
//   x, residual = add_rms_norm(h, residual, ln_attn)     (rms_norm on the first layer)
//   q, k, v     = qkv(x) split;  q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)  (Qwen3)
//   q           = rope_kv_write(q, k, v -> the caches)
//   h           = o(decode_attention(q, caches))
//   x, residual = add_rms_norm(h, residual, ln_mlp);  h = down(silu_mul(gate_up(x)))
//
// so its output is bit-identical to the loop's (tests/test_fused_decode.py).
#include "decode_layers.h"

#include <utility>

namespace {
std::optional<Tensor> layer_of(const std::optional<Tensor>& t, int64_t i) {
  return t.has_value() ? std::optional<Tensor>(t->select(0, i)) : std::nullopt;
}
}  // namespace

DecodeStack::DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                         double scale, double softcap)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
      softcap_(softcap) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "bad head counts");
}

void DecodeStack::add_layer(DecodeLayer layer) { layers_.push_back(std::move(layer)); }

std::tuple<Tensor, Tensor> DecodeStack::run(Tensor h, Tensor positions, Tensor slots,
                                            Tensor starts, Tensor lens, Tensor k, Tensor v,
                                            std::optional<Tensor> k_scale,
                                            std::optional<Tensor> v_scale) const {
  const int64_t T = h.size(0), qw = heads_ * head_dim_, kvw = kv_heads_ * head_dim_;
  TORCH_CHECK(h.dim() == 2 && starts.size(0) == T && lens.size(0) == T,
              "h must be [T, hidden], a decode row per sequence");
  TORCH_CHECK(k.size(0) == static_cast<int64_t>(layers_.size()),
              "the caches must hold every layer");
  Tensor residual;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const DecodeLayer& L = layers_[li];
    const auto i = static_cast<int64_t>(li);
    Tensor x;
    if (residual.defined()) {
      std::tie(x, residual) = add_rms_norm(h, residual, L.ln_attn, eps_);
    } else {
      x = rms_norm(h, L.ln_attn, eps_);
      residual = h;
    }
    const Tensor qkv = L.qkv(x);
    Tensor q = qkv.narrow(1, 0, qw).view({T, heads_, head_dim_});
    Tensor kk = qkv.narrow(1, qw, kvw).view({T, kv_heads_, head_dim_});
    if (L.q_norm.has_value()) {
      q = rms_norm(q, *L.q_norm, eps_);
      kk = rms_norm(kk, *L.k_norm, eps_);
    }
    const Tensor vv = qkv.narrow(1, qw + kvw, kvw).view({T, kv_heads_, head_dim_});
    const Tensor k_cache = k.select(0, i), v_cache = v.select(0, i);
    const auto ks = layer_of(k_scale, i), vs = layer_of(v_scale, i);
    const Tensor q_rot =
        std::get<0>(rope_kv_write(q, kk, vv, positions, L.cos, L.sin, k_cache, v_cache, slots,
                                  ks, vs));
    const Tensor attn = decode_attention(q_rot, k_cache, v_cache, starts, lens, scale_, ks, vs,
                                         L.window, softcap_);
    h = L.o(attn.reshape({T, qw}));
    std::tie(x, residual) = add_rms_norm(h, residual, L.ln_mlp, eps_);
    h = L.down(silu_mul(L.gate_up(x)));
  }
  return {h, residual};
}

std::tuple<Tensor, Tensor> decode_layers(const DecodeStack& stack, Tensor h, Tensor positions,
                                         Tensor slots, Tensor starts, Tensor lens, Tensor k,
                                         Tensor v, std::optional<Tensor> k_scale,
                                         std::optional<Tensor> v_scale) {
  return stack.run(h, positions, slots, starts, lens, k, v, k_scale, v_scale);
}
