"""Gemma 2 and Gemma 3 fields of a model config (pipellm/shared/model_config.py), read as
transformers' Gemma2Config / Gemma3TextConfig read them. What a Gemma decoder does beyond Llama's:

- RMSNorm scales by (1 + w), not w (`norm_weight_offset` 1: the loader folds it in);
- sandwich norms: a norm after attention and after the MLP, before each residual add;
- embeddings scaled by sqrt(hidden_size), in the weights' dtype;
- the MLP gates with GELU (tanh approximation) instead of SiLU;
- attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- sliding-window and full layers interleaved (Gemma 2: every other layer slides; Gemma 3: five
  of every six), Gemma 3's sliding layers with their own unscaled RoPE base;
- soft-capping (cap * tanh(x / cap)) of the attention scores and the final logits where the
  config sets it (Gemma 2: 50 and 30; Gemma 3: none), and per-head q/k norms (Gemma 3).
"""

from __future__ import annotations

from typing import Any

from pipellm.shared.config_fields import ConfigFields

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
GEMMA3_MULTIMODAL = "Gemma3ForConditionalGeneration"  # 4B and up: served as text only
GEMMA_ARCHITECTURES = (GEMMA3, GEMMA3_MULTIMODAL, GEMMA2)
# Gemma3TextConfig's defaults, which the Hub's multimodal configs rely on (their text_config
# names only what differs, e.g. 4B: hidden 2560, intermediate 10240, 34 layers, window 1024)
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "num_attention_heads": 8,
                         "num_key_value_heads": 4, "head_dim": 256,
                         "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                         "sliding_window": 4096, "tie_word_embeddings": True}
GEMMA_ACTIVATION = "gelu_pytorch_tanh"
# transformers' defaults where a config omits the field
_QUERY_PRE_ATTN_SCALAR = 256
_LOCAL_ROPE_THETA = 10_000.0  # Gemma3TextConfig.default_theta["local"]
GEMMA3_ROPE_THETA = 1_000_000.0  # ... ["global"]
_SOFTCAPS = {GEMMA2: (50.0, 30.0), GEMMA3: (None, None)}  # (attention, final logits)
SLIDING_PATTERN = {GEMMA2: 2, GEMMA3: 6}  # every n-th layer is full, the others slide


def gemma_fields(f: ConfigFields, arch: str, hidden: int) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma architecture ({} for the others)."""
    if arch not in GEMMA_ARCHITECTURES:
        return {}
    if f.cfg.get("use_bidirectional_attention"):
        raise f.error("use_bidirectional_attention=true (an embedding model) is not supported")
    attn_cap, final_cap = _SOFTCAPS[arch]
    return {
        "hidden_act": GEMMA_ACTIVATION,
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": hidden**0.5,
        "query_pre_attn_scalar": f.get_float("query_pre_attn_scalar", _QUERY_PRE_ATTN_SCALAR),
        "attn_softcap": _softcap(f, "attn_logit_softcapping", attn_cap),
        "final_softcap": _softcap(f, "final_logit_softcapping", final_cap),
        "local_rope_theta": _local_rope_theta(f) if arch == GEMMA3 else None,
    }


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 multimodal config.json as its language model's (Gemma3ForCausalLM's):
    `text_config` over Gemma3TextConfig's defaults, with the top level's token ids and dtype;
    any other config as is."""
    if cfg.get("architectures") != [GEMMA3_MULTIMODAL]:
        return cfg
    text = cfg.get("text_config") or {}
    if not isinstance(text, dict):
        return cfg  # ConfigFields reports the missing fields
    top = {k: cfg[k] for k in ("eos_token_id", "bos_token_id", "dtype", "torch_dtype")
           if k in cfg}
    return {**_GEMMA3_TEXT_DEFAULTS, **top, **text, "architectures": [GEMMA3]}


def gemma_activation(f: ConfigFields) -> None:
    """Gemma configs name their activation `hidden_activation` (older ones `hidden_act` too):
    only GELU's tanh approximation is served."""
    for key in ("hidden_activation", "hidden_act"):
        act = f.cfg.get(key)
        if act is not None and act != GEMMA_ACTIVATION:
            raise f.error(f"{key} {act!r} is not supported for Gemma (only "
                          f"{GEMMA_ACTIVATION!r})")


def full_rope_params(f: ConfigFields, params: dict) -> dict:
    """Gemma 3's v5 `rope_parameters` ({layer type: parameters}): the full layers' parameters,
    which the model's main RoPE takes (the sliding layers' base is `local_rope_theta`)."""
    full = params.get("full_attention") or {}
    if not isinstance(full, dict):
        raise f.error(f"rope_parameters['full_attention'] must be a JSON object, got {full!r}")
    return dict(full)


def _local_rope_theta(f: ConfigFields) -> float:
    """The sliding layers' RoPE base: v5 rope_parameters['sliding_attention'], else v4
    `rope_local_base_freq`, else 10000; only unscaled RoPE is served there (as transformers
    builds it by default)."""
    params = f.cfg.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    if isinstance(local, dict):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise f.error(f"rope type {kind!r} on the sliding layers is not supported "
                          "(only 'default')")
        if "rope_theta" in local:
            return f.get_float("rope_theta", _LOCAL_ROPE_THETA, source=local)
    return f.get_float("rope_local_base_freq", _LOCAL_ROPE_THETA)


def _softcap(f: ConfigFields, key: str, default: float | None) -> float:
    """The field's cap, 0 for none: the architecture's default when the field is absent, none
    when it is null (as transformers reads both)."""
    if key not in f.cfg:
        return default or 0.0
    return 0.0 if f.cfg[key] is None else f.get_float(key, 0.0)
