"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, TinyLlama) running one merged step.

Every op but attention runs on the flat token batch [T, hidden]; attention splits into the
decode tokens and the prefill chunks, each a call into `kernels/`. Only the rows in
`batch.logits_indices` go through the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import decode_attention, prefill_attention
from services.compute.batch import ForwardBatch
from services.compute.kv_cache import KVCache
from services.compute.model_config import ModelConfig
from services.compute.rope import RotaryEmbedding
from services.compute.weights import require


@dataclass
class LayerWeights:
    qkv: torch.Tensor  # [(H + 2 * Hkv) * D, hidden], q, k, v projections fused
    qkv_bias: torch.Tensor | None  # [(H + 2 * Hkv) * D]
    o: torch.Tensor  # [hidden, H * D]
    gate_up: torch.Tensor  # [2 * inter, hidden], gate and up fused
    down: torch.Tensor  # [hidden, inter]
    ln_attn: torch.Tensor  # [hidden]
    ln_mlp: torch.Tensor  # [hidden]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF: normalize in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 max_positions: int):
        self.cfg = cfg
        self.embed = require(weights, "model.embed_tokens.weight")
        self.norm = require(weights, "model.norm.weight")
        head = weights.get("lm_head.weight")
        if head is None and not cfg.tie_word_embeddings:
            head = require(weights, "lm_head.weight")
        self.lm_head = self.embed if head is None else head
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                    cfg.rope_scaling, device)
        self.scale = cfg.head_dim**-0.5

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        qkv = [require(w, f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        bias = None
        if self.cfg.attention_bias:
            bias = torch.cat([require(w, f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        return LayerWeights(
            qkv=torch.cat(qkv),
            qkv_bias=bias,
            o=require(w, f"{p}self_attn.o_proj.weight"),
            gate_up=torch.cat([require(w, f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]),
            down=require(w, f"{p}mlp.down_proj.weight"),
            ln_attn=require(w, f"{p}input_layernorm.weight"),
            ln_mlp=require(w, f"{p}post_attention_layernorm.weight"),
        )

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one merged step, writing this step's K/V into `kv`. Returns [S, vocab] float32."""
        h = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer, rms_norm(h, layer.ln_attn, self.cfg.rms_norm_eps),
                                    batch, kv)
            h = h + self._mlp(layer, rms_norm(h, layer.ln_mlp, self.cfg.rms_norm_eps))
        last = rms_norm(h[batch.logits_indices], self.norm, self.cfg.rms_norm_eps)
        return F.linear(last, self.lm_head).float()

    def _attention(self, i: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch,
                   kv: KVCache) -> torch.Tensor:
        c = self.cfg
        T = x.shape[0]
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                             c.num_kv_heads * c.head_dim], dim=-1)
        q = self.rope(q.view(T, c.num_heads, c.head_dim), batch.positions)
        k = self.rope(k.view(T, c.num_kv_heads, c.head_dim), batch.positions)
        k_cache, v_cache = kv.write(i, batch.slots, k, v.view(T, c.num_kv_heads, c.head_dim))
        out = torch.empty_like(q)
        nd = batch.num_decodes
        if nd:
            out[:nd] = decode_attention(q[:nd], k_cache, v_cache, batch.decode_kv_starts,
                                        batch.decode_kv_lens, self.scale)
        if T > nd:
            out[nd:] = prefill_attention(q[nd:], k_cache, v_cache, batch.prefill_cu_q_lens,
                                         batch.prefill_kv_starts, batch.prefill_kv_lens,
                                         self.scale)
        return F.linear(out.view(T, -1), layer.o)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)
