"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, TinyLlama) running
one merged step.

Every op but attention runs on the flat token batch [T, hidden]; attention splits into the
decode tokens and the prefill chunks, each a call into `pipellm/kernels/`, with the layer's sliding
window (0: full attention; Mistral's on every layer, Qwen2's from max_window_layers on). Only
the rows in `batch.logits_indices` go through the final norm and the LM head. What the
architectures store differently (Phi-3's fused projections, Qwen3's q/k norms, partial rotary)
is read in `arch.py`; the mixture-of-experts MLPs (Qwen3-MoE, Mixtral, OLMoE) in `moe.py`.
Gemma's differences are config fields (pipellm/shared/model_config_gemma.py): sandwich norms, scaled
embeddings, GELU-tanh gating, its attention scale, soft-capped scores and logits, and its
sliding layers' own RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipellm.kernels import (
    add_rms_norm,
    decode_attention,
    gelu_tanh_mul,
    prefill_attention,
    rms_norm,
    rms_norm_int8,
    rope_kv_write,
    silu_mul,
    silu_mul_int8,
)
from pipellm.kernels.int8_quant import quantize_int8
from pipellm.services.compute.core.batch import ForwardBatch
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.services.compute.model.arch import full_qk_norm, fuse, layer_norms, qk_norms, qkv_rows
from pipellm.services.compute.model.fused_decode import fused_decode
from pipellm.services.compute.model.linear.lora import LoraLinear
from pipellm.services.compute.model.moe import mlp_layers
from pipellm.services.compute.model.quantization import Quantization
from pipellm.services.compute.model.rope import RotaryEmbedding
from pipellm.services.compute.model.weights import require
from pipellm.shared.model_config import ModelConfig


@dataclass
class LayerWeights:
    """The projections are linear layers of the quantization method's kind (`model/linear/`)."""

    qkv: object  # [(H + 2 * Hkv) * D, hidden] (+ bias), q, k, v projections fused
    o: object  # [hidden, H * D]
    gate_up: object | None  # [2 * inter, hidden], gate and up fused (None: a sparse layer)
    down: object | None  # [hidden, inter]
    ln_attn: torch.Tensor  # [hidden], the attention's input norm
    ln_mlp: torch.Tensor  # [hidden], the MLP's
    post_attn: torch.Tensor | None = None  # [hidden], on the attention's output (Gemma)
    post_mlp: torch.Tensor | None = None  # [hidden], on the MLP's output (Gemma)
    q_norm: torch.Tensor | None = None  # [D], on each q head before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None  # [D], on each k head
    moe: object | None = None  # the sparse MLP (moe.MoE) in place of gate_up and down


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 max_positions: int, quant: Quantization | None = None,
                 experts: range | None = None):
        """`experts`: the experts each sparse layer holds (None: all; a block of them on an
        expert-parallel rank, pipellm/services/compute/tp/), `weights` holding theirs."""
        self.cfg = cfg
        self.experts = experts
        self.quant = quant or Quantization()
        self.int8_act = self.quant.int8_activations  # norms and SiLU x mul hand out int8 rows
        self.embed = require(weights, "model.embed_tokens.weight")
        self.norm = require(weights, "model.norm.weight")
        head = weights.get("lm_head.weight")
        # a sequence classification checkpoint's head [num_labels, hidden] (pooling/scoring.py)
        self.score = weights.get("score.weight")
        if head is None and not cfg.tie_word_embeddings and self.score is None:
            head = require(weights, "lm_head.weight")
        self.lm_head = None if head is None and not cfg.tie_word_embeddings else \
            self.quant.head(self.embed if head is None else head)  # [vocab, hidden]
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        # [num_layers] Python ints, 0 = full attention: kernel constants (Triton specializes on
        # them; a CUDA graph captures each layer's launch with its own)
        self.windows = tuple(cfg.layer_window(i) for i in range(cfg.num_layers))
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                    cfg.rope_scaling, device, cfg.rotary_dim)
        local = self.rope if cfg.local_rope_theta is None else RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.local_rope_theta, None, device, cfg.rotary_dim)
        self.ropes = tuple(local if w else self.rope for w in self.windows)  # [num_layers]
        self.scale = cfg.attention_scale
        # embeddings x sqrt(hidden) for Gemma, the factor rounded to the weights' dtype (as HF)
        self.embed_scale = (None if cfg.embed_scale == 1 else
                            torch.tensor(cfg.embed_scale, dtype=self.embed.dtype, device=device))
        self.act = _activation(cfg.hidden_act, self.int8_act)
        # adapters served -> their slot in every LoraLinear's stacks (lora/attach.py)
        self.lora_slots: dict[str, int] = {}
        # W8A8: each layer's SmoothQuant scales per site (smoothing.smooth), which adapters'
        # factors follow; None when the weights were not smoothed
        self.smoothing: list[dict[str, torch.Tensor]] | None = None
        # the layers of a decode step in one C++ call where they are plain (None: the loop)
        self.fused = fused_decode(self)

    @property
    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters served."""
        return frozenset(self.lora_slots)

    def _layer(self, w: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"model.layers.{i}."
        linear = self.quant.linear
        bias = None
        if self.cfg.attention_bias:
            bias = torch.cat([require(w, f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
        qkv = fuse([require(w, f"{p}self_attn.{n}_proj.weight") for n in "qkv"])
        q_norm, k_norm = qk_norms(self.cfg, w, p)
        return LayerWeights(
            qkv=full_qk_norm(self.cfg, linear(*qkv_rows(self.cfg, qkv, bias)), w, p),
            o=linear(require(w, f"{p}self_attn.o_proj.weight")),
            **mlp_layers(self.cfg, w, i, self.quant, self.experts),
            **layer_norms(self.cfg, w, p),
            q_norm=q_norm,
            k_norm=k_norm,
        )

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one merged step, writing this step's K/V into `kv`. Returns [S, vocab] float32."""
        return self.forward_hidden(batch, kv)[0]

    def forward_hidden(self, batch: ForwardBatch, kv: KVCache,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the final-normed hidden states the logits came from: [S, hidden]."""
        last = self.normed_hidden(batch, kv, batch.logits_indices)  # [S, hidden]
        logits = self.lm_head(last).float()
        if self.cfg.final_softcap:  # Gemma 2: cap * tanh(logits / cap)
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits, last

    def normed_hidden(self, batch: ForwardBatch, kv: KVCache,
                      rows: torch.Tensor | None = None, trim: bool = False) -> torch.Tensor:
        """Run the layers of one merged step, writing its K/V into `kv`; the final-normed
        hidden states of `rows` (None: every row): [len(rows) or T, hidden]. `trim`: the last
        layer's MLP runs on `rows` alone (what follows its attention works row by row; not
        with LoRA, whose adapter rows index the whole step)."""
        h = self._embed_tokens(batch.input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.fused is not None and self.fused.takes(batch, kv):
            h, residual = self.fused(h, batch, kv)
        else:
            h, residual, rows = self._layers(h, batch, kv, rows, trim)
        if rows is not None:
            h, residual = h[rows], residual[rows]
        return self._norm(h, residual, self.norm)[0]

    def _layers(self, h: torch.Tensor, batch: ForwardBatch, kv: KVCache,
                rows: torch.Tensor | None, trim: bool):
        """(h, residual, rows) after the last layer's MLP (rows: None once trimmed to them)."""
        residual = None  # the residual stream; h is what gets added to it next
        for i, layer in enumerate(self.layers):
            x, residual = self._norm(h, residual, layer.ln_attn, self.int8_act)
            h = self._post_norm(self._attention(i, layer, x, batch, kv), layer.post_attn)
            if trim and rows is not None and i == len(self.layers) - 1 and batch.lora is None:
                h, residual, rows = h[rows], residual[rows], None
            # the router reads float rows: a sparse layer's experts quantize their own input
            x, residual = self._norm(h, residual, layer.ln_mlp,
                                     self.int8_act and layer.moe is None)
            h = layer.moe(x) if layer.moe is not None else self._mlp(layer, x, batch)
            h = self._post_norm(h, layer.post_mlp)
        return h, residual, rows

    def own_factors(self, factors: dict) -> dict:
        """A LoRA adapter's factors (lora/weights.read_factors) as this model's projections
        take them: all of them (a tensor-parallel rank's: its slices,
        pipellm/services/compute/tp/)."""
        return factors

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of token ids [T]: [T, hidden] (a tensor-parallel rank's are
        gathered across ranks: pipellm/services/compute/tp/model.py)."""
        return F.embedding(ids, self.embed)

    def weight_bytes(self) -> int:
        """Bytes the weights take as served (embedding, norms, projections, experts, LM
        head)."""
        projections = sum(getattr(layer, f).nbytes() for layer in self.layers
                          for f in ("qkv", "o", "gate_up", "down", "moe")
                          if getattr(layer, f) is not None)
        tensors = [self.embed, self.norm] + [
            t for layer in self.layers for t in (layer.ln_attn, layer.ln_mlp, layer.post_attn,
                                                 layer.post_mlp, layer.q_norm, layer.k_norm)
            if t is not None]
        shared = getattr(self.lm_head, "weight", None) is self.embed  # tied and not repacked
        head = 0 if shared or self.lm_head is None else self.lm_head.nbytes()
        return projections + head + sum(t.numel() * t.element_size() for t in tensors)

    def _norm(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              int8: bool = False):
        """(rms_norm(residual + h), residual + h): HF's residual add and norm, fused; with
        `int8`, the normed rows come as an Int8Activation (W8A8)."""
        if int8:
            x, res = rms_norm_int8(h, residual, weight, self.cfg.rms_norm_eps)
            return x, h if res is None else res
        if residual is None:
            return rms_norm(h, weight, self.cfg.rms_norm_eps), h
        return add_rms_norm(h, residual, weight, self.cfg.rms_norm_eps)

    def _post_norm(self, h: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """h normed by a sandwich norm's weight before the residual add (as is without one)."""
        return h if weight is None else rms_norm(h, weight, self.cfg.rms_norm_eps)

    def _attention(self, i: int, layer: LayerWeights, x: torch.Tensor, batch: ForwardBatch,
                   kv: KVCache) -> torch.Tensor:
        c = self.cfg
        T = batch.input_ids.shape[0]  # x may be an Int8Activation (W8A8)
        qkv = _project(layer.qkv, x, batch)
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                             c.num_kv_heads * c.head_dim], dim=-1)
        q, k = q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:  # Qwen3: RMSNorm each head, before RoPE
            q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
        k_scale, v_scale = kv.scales(i)  # None, None unless the cache is INT8
        rope = self.ropes[i]
        q, _ = rope_kv_write(q, k, v.view(T, c.num_kv_heads, c.head_dim), batch.positions,
                             rope.cos, rope.sin, kv.k[i], kv.v[i], batch.slots, k_scale, v_scale)
        nd, window, cap = batch.num_decodes, self.windows[i], c.attn_softcap
        parts = []  # [T, H, D]: the decode rows, then the prefill chunks'
        if nd:
            parts.append(decode_attention(q[:nd], kv.k[i], kv.v[i], batch.decode_starts,
                                          batch.decode_lens, self.scale,
                                          max_seq_len=batch.max_decode_len, k_scale=k_scale,
                                          v_scale=v_scale, window=window, softcap=cap))
        if T > nd:
            parts.append(prefill_attention(q[nd:], kv.k[i], kv.v[i], batch.prefill_cu,
                                           batch.prefill_starts, batch.prefill_lens, self.scale,
                                           max_q_len=batch.max_chunk_len, k_scale=k_scale,
                                           v_scale=v_scale, window=window, softcap=cap,
                                           coarse_p=batch.coarse_p))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return _project(layer.o, out.reshape(T, -1), batch)

    def _mlp(self, layer: LayerWeights, x, batch: ForwardBatch) -> torch.Tensor:
        """The dense MLP: down(act(gate_up(x)))."""
        return _project(layer.down, self.act(_project(layer.gate_up, x, batch)), batch)


def _project(linear, x, batch: ForwardBatch) -> torch.Tensor:
    """linear(x), plus the LoRA delta of each adapter the step has rows of where the
    projection serves adapters (a draft model's do not)."""
    if batch.lora is None or not isinstance(linear, LoraLinear):
        return linear(x)
    return linear(x, batch.lora)


def _activation(hidden_act: str, int8: bool):
    """The MLP's gated activation [T, 2I] -> [T, I]: SiLU or GELU-tanh of the gate times up;
    with `int8` (W8A8) its rows come quantized (an Int8Activation)."""
    if hidden_act == "silu":
        return silu_mul_int8 if int8 else silu_mul
    return (lambda gate_up: quantize_int8(gelu_tanh_mul(gate_up))) if int8 else gelu_tanh_mul
