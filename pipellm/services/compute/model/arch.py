"""What the supported architectures store differently, brought to the decoder's one layout:
Phi-3's fused q/k/v and gate/up (`split_fused`), Qwen3's per-head q/k norms (`qk_norms`),
partial rotary's reordered q/k rows (`qkv_rows`), OLMoE's whole-q/k norms and q/k/v clamp
(`FullQKNorm`), Gemma's sandwich norms (`layer_norms`); mixture-of-experts MLPs in `moe.py`.
Invariant: everything that reads weights sees Llama's names and layout.
"""

from __future__ import annotations

import torch

from pipellm.kernels import rms_norm
from pipellm.kernels.int4_weight import Int4Weight, quantize_int4
from pipellm.services.compute.model.rope import head_order
from pipellm.services.compute.model.weights import require
from pipellm.shared.model_config import ModelConfig, ModelLoadError

_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def split_fused(cfg: ModelConfig, weights: dict) -> dict:
    """A copy of `weights` with every fused Phi-3 projection replaced by its parts (row views)
    under Llama's names. Raises ModelLoadError naming a fused tensor of the wrong row count,
    or a missing one (of a Phi-3 checkpoint that has no separate one either)."""
    hd = cfg.head_dim
    sizes = {"self_attn.qkv_proj": [cfg.num_heads * hd, cfg.num_kv_heads * hd,
                                    cfg.num_kv_heads * hd],
             "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    out = dict(weights)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for fused, parts in _FUSED.items():
            name = f"{p}{fused}.weight"
            if name not in out:
                if cfg.architecture == "Phi3ForCausalLM" and f"{p}{parts[0]}.weight" not in out:
                    require(out, name)
                continue
            w = out.pop(name)
            if w.shape[0] != sum(sizes[fused]):
                raise ModelLoadError(f"tensor '{name}' has {w.shape[0]} rows; the config's "
                                     f"shape makes {' + '.join(map(str, sizes[fused]))}")
            for part, rows in zip(parts, _split_rows(w, sizes[fused]), strict=True):
                out[f"{p}{part}.weight"] = rows
    return out


def mlp_norm(cfg: ModelConfig) -> str:
    """The name of a layer's MLP input norm (under `model.layers.{i}.`)."""
    return "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"


def layer_norms(cfg: ModelConfig, w: dict, prefix: str) -> dict[str, torch.Tensor | None]:
    """A layer's RMSNorm weights [hidden] as LayerWeights fields: the attention's and the MLP's
    input norms (ln_attn, ln_mlp) and, with sandwich norms, their output norms (post_attn,
    post_mlp; None otherwise)."""
    def norm(name: str) -> torch.Tensor:
        return require(w, f"{prefix}{name}.weight")

    sandwich = cfg.sandwich_norms
    return dict(ln_attn=norm("input_layernorm"), ln_mlp=norm(mlp_norm(cfg)),
                post_attn=norm("post_attention_layernorm") if sandwich else None,
                post_mlp=norm("post_feedforward_layernorm") if sandwich else None)


def fuse(weights: list) -> torch.Tensor | Int4Weight:
    """Fuse projections along their output rows (float tensors or INT4 blocks). A float one
    beside INT4 blocks (a GGUF file mixing Q4 and other types) is quantized alike."""
    if not any(isinstance(w, Int4Weight) for w in weights):
        return torch.cat(weights)
    group = next(w.group_size for w in weights if isinstance(w, Int4Weight))
    return Int4Weight.cat([w if isinstance(w, Int4Weight) else quantize_int4(w, group)
                           for w in weights])


def qkv_rows(cfg: ModelConfig, weight, bias: torch.Tensor | None):
    """(weight, bias) of the fused q/k/v projection, q and k rows in the decoder's head order."""
    index = _qkv_index(cfg)
    if index is None:
        return weight, bias
    return _rows(weight, index), None if bias is None else _take(bias, index)


def qk_norms(cfg: ModelConfig, w: dict, prefix: str
             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(q_norm, k_norm) weights [head_dim] of a layer (`prefix`: `model.layers.{i}.`), in the
    decoder's head order; (None, None) for architectures without them."""
    if not cfg.qk_norm:
        return None, None
    order = head_order(cfg.head_dim, cfg.rotary_dim)
    norms = [require(w, f"{prefix}self_attn.{n}_norm.weight") for n in "qk"]
    return tuple(n if order is None else _take(n, order) for n in norms)


class FullQKNorm:
    """OLMoE's q/k/v projection: `qkv` (a linear layer, x [T, hidden] -> [T, (H + 2 Hkv) D]),
    then RMSNorm over all of q and all of k (weights [H * D], [Hkv * D]), then q, k, v clamped
    to +-clip when set. Called and sized as the linear layer it wraps."""

    def __init__(self, cfg: ModelConfig, qkv, w: dict, prefix: str):
        self.qkv, self.eps, self.clip = qkv, cfg.rms_norm_eps, cfg.clip_qkv
        self.q_norm, self.k_norm = (require(w, f"{prefix}self_attn.{n}_norm.weight")
                                    for n in "qk")
        self.q_cols = cfg.num_heads * cfg.head_dim  # q's columns; k's follow, then v's
        self.k_cols = cfg.num_kv_heads * cfg.head_dim
        for norm, cols in ((self.q_norm, self.q_cols), (self.k_norm, self.k_cols)):
            if norm.shape != (cols,):
                raise ModelLoadError(f"{prefix}self_attn q/k norm has shape {tuple(norm.shape)};"
                                     f" the config's projection has {cols} columns")

    def __call__(self, x) -> torch.Tensor:
        out = self.qkv(x)  # [T, (H + 2 Hkv) D]
        q, k = out[:, :self.q_cols], out[:, self.q_cols:self.q_cols + self.k_cols]
        out[:, :self.q_cols] = rms_norm(q.contiguous(), self.q_norm, self.eps)
        out[:, self.q_cols:self.q_cols + self.k_cols] = rms_norm(k.contiguous(), self.k_norm,
                                                                 self.eps)
        return out if self.clip is None else out.clamp_(-self.clip, self.clip)

    def nbytes(self) -> int:
        return self.qkv.nbytes() + sum(n.numel() * n.element_size()
                                       for n in (self.q_norm, self.k_norm))


def full_qk_norm(cfg: ModelConfig, qkv, w: dict, prefix: str):
    """The layer's q/k/v projection, wrapped in `FullQKNorm` for OLMoE; as is otherwise."""
    return FullQKNorm(cfg, qkv, w, prefix) if cfg.qk_norm_full else qkv


def _qkv_index(cfg: ModelConfig) -> torch.Tensor | None:
    """Row order of the fused q/k/v projection: each q and k head in `head_order`, v as is."""
    order = head_order(cfg.head_dim, cfg.rotary_dim)
    if order is None:
        return None
    hd, heads = cfg.head_dim, cfg.num_heads + cfg.num_kv_heads
    qk = (torch.arange(heads)[:, None] * hd + order[None, :]).flatten()
    return torch.cat([qk, torch.arange(heads * hd, (heads + cfg.num_kv_heads) * hd)])


def _rows(w, index: torch.Tensor):
    """w[index] for a float weight or an Int4Weight (rows first)."""
    if isinstance(w, Int4Weight):
        return Int4Weight(*(_take(t, index) for t in (w.packed, w.scales, w.mins)),
                          w.group_size)
    return _take(w, index)


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return t[index.to(t.device)]


def _split_rows(w, sizes: list[int]) -> list:
    """w split along its rows into parts of `sizes` (views; an Int4Weight field by field)."""
    if isinstance(w, Int4Weight):
        fields = [t.split(sizes) for t in (w.packed, w.scales, w.mins)]
        return [Int4Weight(*parts, w.group_size) for parts in zip(*fields, strict=True)]
    return list(w.split(sizes))
