"""Mixture-of-experts fields of a model config (pipellm/shared/model_config.py calls `moe_fields`),
read as transformers reads them. Errors name the file and field (`ConfigFields.error`).

    Qwen3MoeForCausalLM  num_experts (v5 writes num_local_experts), num_experts_per_tok,
                         moe_intermediate_size, norm_topk_prob; layer i is sparse unless
                         listed in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
                         (Qwen2MoeDecoderLayer); the others are dense MLPs of
                         intermediate_size
    MixtralForCausalLM   num_local_experts, num_experts_per_tok; experts of intermediate_size
                         on every layer; the chosen k weights always renormalized
    OlmoeForCausalLM     num_experts, num_experts_per_tok, norm_topk_prob; experts of
                         intermediate_size on every layer; q/k RMSNorm over the whole
                         projection (not per head) and optional clip_qkv

Routing (all three): softmax over all experts in float32, top-k, then (norm_topk_prob, always
for Mixtral) the k weights divided by their sum.
"""

from __future__ import annotations

from typing import Any

from pipellm.shared.config_fields import ConfigFields

QWEN3_MOE, MIXTRAL, OLMOE = "Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"
MOE_ARCHITECTURES = (QWEN3_MOE, MIXTRAL, OLMOE)


def moe_fields(f: ConfigFields, arch: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's MoE fields ({} for a dense architecture): num_experts,
    num_experts_per_tok, moe_intermediate_size, norm_topk_prob, moe_layers (the sparse layers'
    indices), plus OLMoE's qk_norm_full and clip_qkv."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    # transformers aliases the two (v5 writes Qwen3-MoE's as num_local_experts)
    keys = ("num_local_experts", "num_experts")
    experts_key = next((k for k in keys if f.cfg.get(k) is not None),
                       keys[0] if arch == MIXTRAL else keys[1])
    experts = f.get_int(experts_key, required=True)
    top_k = f.get_int("num_experts_per_tok", required=True)
    if top_k > experts:
        raise f.error(f"field 'num_experts_per_tok' ({top_k}) exceeds '{experts_key}' "
                      f"({experts})")
    if arch == QWEN3_MOE:
        inter = f.get_int("moe_intermediate_size", required=True)
        layers = _qwen_sparse_layers(f, num_layers)
    else:  # Mixtral, OLMoE: every layer's MLP is the experts, of intermediate_size
        inter = f.get_int("intermediate_size", required=True)
        layers = tuple(range(num_layers))
    out = dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
               norm_topk_prob=arch == MIXTRAL or f.get_bool("norm_topk_prob", False),
               moe_layers=layers)
    if arch == OLMOE:
        out |= dict(qk_norm_full=True, clip_qkv=_clip_qkv(f))
    return out


def moe_window(f: ConfigFields, arch: str, window: int | None) -> int | None:
    """Qwen3-MoE's attention window: transformers' Qwen3MoeConfig drops `sliding_window`
    unless `use_sliding_window`, then every layer slides (one mask for all)."""
    if arch == QWEN3_MOE and not f.get_bool("use_sliding_window", False):
        return None
    if arch == OLMOE:  # OlmoeConfig has no window; a stray field is ignored as transformers does
        return None
    return window


def _qwen_sparse_layers(f: ConfigFields, num_layers: int) -> tuple[int, ...]:
    step = f.get_int("decoder_sparse_step", 1)
    dense = f.cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
            for i in dense):
        raise f.error(f"field 'mlp_only_layers' must list layer indices below {num_layers}, "
                      f"got {dense!r}")
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _clip_qkv(f: ConfigFields) -> float | None:
    value = f.cfg.get("clip_qkv")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise f.error(f"field 'clip_qkv' must be a positive number or null, got {value!r}")
    return float(value)
