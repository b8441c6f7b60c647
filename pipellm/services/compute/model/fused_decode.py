"""A decode step's decoder layers in one C++ call (pipellm/kernels/cpu/decode_layers.cpp):
LlamaModel's layer loop for a plain Llama-family model on the C++ CPU kernels (RMSNorms, fused qkv,
Qwen3's q/k norms, RoPE, SiLU-gated MLP, INT4 block projections; no MoE, sandwich norms, W8A8,
tensor parallelism), the same kernels in the same order, so bit-identical to it
(tests/test_fused_decode.py). It takes steps of decode rows only, without LoRA rows, over a
cache the C++ kernels read (not FP8). What it saves is the host's share of a small step: the
Python, pybind and dispatch around ~9 kernel calls a layer."""

from __future__ import annotations

import torch

from pipellm.kernels import dispatch
from pipellm.kernels.cpu import extension
from pipellm.kernels.int4_cpu import Int4Blocks
from pipellm.kernels.kv_quant import FP8
from pipellm.services.compute.core.batch import ForwardBatch
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.services.compute.model.linear.amx import AmxRows
from pipellm.services.compute.model.linear.int4 import Int4Linear
from pipellm.services.compute.model.linear.lora import LoraLinear


class FusedDecode:
    """The model's layers as one `DecodeStack` (built once, holding the weights' tensors);
    `max_rows`: the rows below which every projection takes its block GEMM (AmxRows' switch to
    oneDNN)."""

    def __init__(self, stack, num_layers: int, max_rows: float):
        self.stack, self.num_layers, self.max_rows = stack, num_layers, max_rows

    def takes(self, batch: ForwardBatch, kv: KVCache) -> bool:
        return (0 < batch.num_decodes == batch.input_ids.shape[0] < self.max_rows
                and batch.lora is None and dispatch.backend() == "auto" and kv.k.dtype != FP8
                and kv.k.shape[0] == self.num_layers)

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) after the last layer's MLP, from the step's embeddings h [T, hidden]."""
        return extension().decode_layers(self.stack, h, batch.positions, batch.slots,
                                         batch.decode_starts, batch.decode_lens, kv.k, kv.v,
                                         kv.k_scale, kv.v_scale)


def fused_decode(model) -> FusedDecode | None:
    """`model`'s layers as a FusedDecode, or None where it has a layer the C++ stack does not
    run or the C++ kernels do not serve it (another backend, no block GEMMs here)."""
    from pipellm.services.compute.model.llama import LlamaModel

    cfg = model.cfg
    if (type(model) is not LlamaModel or model.int8_act or cfg.hidden_act != "silu"
            or (ext := dispatch.block_gemm_extension(model.embed)) is None):
        return None
    projections = [[getattr(layer, n) for n in ("qkv", "o", "gate_up", "down")]
                   for layer in model.layers]
    layers = [(layer, [_blocks(ext, p) for p in ps])
              for layer, ps in zip(model.layers, projections, strict=True)]
    if any(layer.moe is not None or layer.post_attn is not None
           or layer.post_mlp is not None or any(p is None for p in linears)
           or {layer.ln_attn.dtype, layer.ln_mlp.dtype} != {model.embed.dtype}
           for layer, linears in layers):
        return None
    stack = ext.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                            model.scale, cfg.attn_softcap or 0.0)
    for i, (layer, linears) in enumerate(layers):
        rope = model.ropes[i]
        stack.add_layer(layer.ln_attn, layer.ln_mlp, rope.cos, rope.sin, *linears,
                        model.windows[i], layer.q_norm, layer.k_norm)
    max_rows = min([p.min_rows for ps in projections for p in ps if isinstance(p, AmxRows)],
                   default=float("inf"))
    return FusedDecode(stack, len(model.layers), max_rows)


def _blocks(ext, linear):
    """The projection as the C++ stack's Int4Projection, or None (another kind)."""
    if isinstance(linear, LoraLinear):  # its base serves the steps without LoRA rows
        linear = linear.base
    if isinstance(linear, AmxRows):  # its block GEMM serves the steps of few rows
        linear = linear.small
    if type(linear) is not Int4Linear or not isinstance(linear.weight, Int4Blocks):
        return None
    w = linear.weight
    return ext.Int4Projection(w.qs, w.scales, w.mins, w.out_features, linear.bias)
