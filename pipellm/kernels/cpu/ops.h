// The kernels' entry points, each defined in the .cpp of its concept: what bindings.cpp binds
// and decode_layers.cpp chains.
#pragma once

#include "tensor.h"

#include <optional>
#include <string>
#include <tuple>
#include <vector>

// decode_attention.cpp
Tensor decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_starts,
                        Tensor seq_lens, double scale, std::optional<Tensor> k_scale,
                        std::optional<Tensor> v_scale, int64_t window, double softcap);
std::string decode_attention_variant(int64_t head_dim);
// norm.cpp
Tensor rms_norm(Tensor x, Tensor w, double eps);
std::tuple<Tensor, Tensor> add_rms_norm(Tensor x, Tensor residual, Tensor w, double eps);
std::tuple<Tensor, Tensor, std::optional<Tensor>> rms_norm_int8(
    Tensor x, std::optional<Tensor> residual, Tensor w, double eps);
// activation.cpp
Tensor silu_mul(Tensor gate_up);
// int8_quant.cpp
std::tuple<Tensor, Tensor> quantize_int8(Tensor x);
std::tuple<Tensor, Tensor> silu_mul_int8(Tensor gate_up);
// rope.cpp
std::tuple<Tensor, Tensor> rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor positions,
                                         Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache,
                                         Tensor slots, std::optional<Tensor> k_scale,
                                         std::optional<Tensor> v_scale);
// token_bitmask.cpp
void apply_token_bitmask(Tensor logits, Tensor bitmask, Tensor rows);
// block_gemm.cpp
void set_block_gemm_isa(const std::string& level);
std::string block_gemm_isa();
void set_block_gemm_prefetch(int64_t bytes);
Tensor q4_gemm(Tensor x, Tensor qs, Tensor d, Tensor m, int64_t n, std::optional<Tensor> bias);
Tensor q8_gemm(Tensor x, Tensor qs, Tensor d, Tensor corr, int64_t n,
               std::optional<Tensor> bias);
Tensor q8_gemm_int8_rows(Tensor xq, Tensor x_scale, Tensor qs, Tensor d, Tensor corr, int64_t n);
// lora.cpp
void lora_delta(Tensor y, Tensor x, Tensor a, Tensor b, Tensor rows, Tensor starts,
                Tensor slots, std::vector<int64_t> part_ends, std::optional<Tensor> a_vnni,
                std::optional<Tensor> b_vnni);
// prefill_attention.cpp
bool prefill_attention_amx_ready();
Tensor prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_q_lens,
                         Tensor seq_starts, Tensor ctx_lens, double scale, int64_t window,
                         std::optional<Tensor> k_scale, std::optional<Tensor> v_scale,
                         bool coarse_p);
// sampling.cpp
std::tuple<Tensor, Tensor> sample_rows(Tensor logits, std::optional<Tensor> raw_logits,
                                       Tensor temperature, Tensor top_p, Tensor min_p,
                                       Tensor top_k, Tensor seeds, Tensor steps,
                                       bool need_logprobs);
