"""The memory-bound work of a step, each op in its own module in the Triton tutorials' order:
kernel, launcher, PyTorch reference. The functions exported here choose per call (see
`dispatch.py`): Triton on CUDA, a C++ extension or the reference on CPU, or what
`set_backend` forces.

    silu_mul(gate_up) / gelu_tanh_mul(gate_up) [T, 2I] -> [T, I]: silu(gate) * up, or
                                               gelu_pytorch_tanh(gate) * up (Gemma's MLP)
    rms_norm(x, w, eps) / add_rms_norm(x, residual, w, eps)
    rope_kv_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots[, k_scale, v_scale])
    decode_attention(q, k_cache, v_cache, starts, lens, scale)       one query per sequence
    prefill_attention(q, k_cache, v_cache, cu, starts, lens, scale)  causal chunks
                                               both take window= (sliding window, 0: none)
                                               and softcap= (Gemma 2's logit cap, 0: none)
    quantize_kv(x) / dequantize_kv(q, scales)  the INT8 KV layout; the three above take
                                               k_scale=, v_scale= for INT8 caches
    rms_norm_int8(x, residual, w, eps) / silu_mul_int8(gate_up)   W8A8: per-token INT8 rows
    int8_gemm.int8_gemm / int4_gemm.int4_gemm   the W8A8 and W4A16 GEMMs (model/linear/)
    fused_moe(x, w13, w2, weights, ids)       [T, H] -> [T, H]: top-k experts' SwiGLU, summed
    sample(logits, batch[, raw_logits])       token ids and logprobs; batch: a SamplingBatch
                                              (per-row temperature, top-k/p, min-p, seed, step)
    apply_penalties(...), token_stats(...)
"""

from pipellm.kernels.activation import gelu_tanh_mul, silu_mul
from pipellm.kernels.decode_attention import decode_attention
from pipellm.kernels.dispatch import backend, set_backend
from pipellm.kernels.fused_moe import fused_moe
from pipellm.kernels.int8_quant import silu_mul_int8
from pipellm.kernels.kv_quant import dequantize_kv, quantize_kv
from pipellm.kernels.prefill_attention import prefill_attention
from pipellm.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_int8
from pipellm.kernels.rope import rope_kv_write
from pipellm.kernels.sampling import (
    SamplingBatch,
    apply_penalties,
    sample,
    take_rows,
    to_device,
    token_stats,
)

__all__ = ["SamplingBatch", "add_rms_norm", "apply_penalties", "backend", "decode_attention",
           "dequantize_kv", "fused_moe", "gelu_tanh_mul", "prefill_attention", "quantize_kv",
           "rms_norm", "rms_norm_int8", "rope_kv_write", "sample", "set_backend", "silu_mul",
           "silu_mul_int8", "take_rows", "to_device", "token_stats"]
