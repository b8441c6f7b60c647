"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, TinyLlama) running one merged step.

Every op but attention runs on the flat token batch [T, hidden]; attention splits into the
decode tokens and the prefill chunks, each a call into `kernels/`. Only the rows in
`batch.logits_indices` go through the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import (
    add_rms_norm,
    decode_attention,
    prefill_attention,
    rms_norm,
    rope_kv_write,
    silu_mul,
)
from services.compute.batch import ForwardBatch
from services.compute.kv.kv_cache import KVCache
from services.compute.model.linear import Linear
from services.compute.model.rope import RotaryEmbedding
from services.compute.model.weights import require
from shared.model_config import ModelConfig


@dataclass
class LayerWeights:
    qkv: Linear  # [(H + 2 * Hkv) * D, hidden] (+ bias), q, k, v projections fused
    o: Linear  # [hidden, H * D]
    gate_up: Linear  # [2 * inter, hidden], gate and up fused
    down: Linear  # [hidden, inter]
    ln_attn: torch.Tensor  # [hidden]
    ln_mlp: torch.Tensor  # [hidden]


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 max_positions: int):
        self.cfg = cfg
        self.embed = require(weights, "model.embed_tokens.weight")
        self.norm = require(weights, "model.norm.weight")
        head = weights.get("lm_head.weight")
        if head is None and not cfg.tie_word_embeddings:
            head = require(weights, "lm_head.weight")
        self.lm_head = Linear(self.embed if head is None else head)  # [vocab, hidden]
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
            qkv=Linear(torch.cat(qkv), bias),
            o=Linear(require(w, f"{p}self_attn.o_proj.weight")),
            gate_up=Linear(torch.cat([require(w, f"{p}mlp.{n}_proj.weight")
                                      for n in ("gate", "up")])),
            down=Linear(require(w, f"{p}mlp.down_proj.weight")),
            ln_attn=require(w, f"{p}input_layernorm.weight"),
            ln_mlp=require(w, f"{p}post_attention_layernorm.weight"),
        )

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one merged step, writing this step's K/V into `kv`. Returns [S, vocab] float32."""
        h = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        residual = None  # the residual stream; h is what gets added to it next
        for i, layer in enumerate(self.layers):
            x, residual = self._norm(h, residual, layer.ln_attn)
            h = self._attention(i, layer, x, batch, kv)
            x, residual = self._norm(h, residual, layer.ln_mlp)
            h = layer.down(silu_mul(layer.gate_up(x)))
        rows = batch.logits_indices
        last, _ = self._norm(h[rows], residual[rows], self.norm)  # [S, hidden]
        return self.lm_head(last).float()

    def _norm(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
        """(rms_norm(residual + h), residual + h): HF's residual add and norm, fused."""
        if residual is None:
            return rms_norm(h, weight, self.cfg.rms_norm_eps), h
        return add_rms_norm(h, residual, weight, self.cfg.rms_norm_eps)

    def _attention(self, i: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch,
                   kv: KVCache) -> torch.Tensor:
        c = self.cfg
        T = x.shape[0]
        qkv = layer.qkv(x)
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                             c.num_kv_heads * c.head_dim], dim=-1)
        k_scale, v_scale = kv.scales(i)  # None, None unless the cache is INT8
        q, _ = rope_kv_write(q.view(T, c.num_heads, c.head_dim),
                             k.view(T, c.num_kv_heads, c.head_dim),
                             v.view(T, c.num_kv_heads, c.head_dim), batch.positions,
                             self.rope.cos, self.rope.sin, kv.k[i], kv.v[i], batch.slots,
                             k_scale, v_scale)
        out = torch.empty_like(q)  # [T, H, D]
        nd = batch.num_decodes
        if nd:
            out[:nd] = decode_attention(q[:nd], kv.k[i], kv.v[i], batch.decode_starts,
                                        batch.decode_lens, self.scale,
                                        max_seq_len=batch.max_decode_len, k_scale=k_scale,
                                        v_scale=v_scale)
        if T > nd:
            out[nd:] = prefill_attention(q[nd:], kv.k[i], kv.v[i], batch.prefill_cu,
                                         batch.prefill_starts, batch.prefill_lens, self.scale,
                                         max_q_len=batch.max_chunk_len, k_scale=k_scale,
                                         v_scale=v_scale)
        return layer.o(out.view(T, -1))
