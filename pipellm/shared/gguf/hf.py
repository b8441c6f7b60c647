"""A GGUF file's metadata in Hugging Face terms: `config.json` and `tokenizer_config.json` fields.

The model-config and chat-template loaders take these dicts exactly as they take the JSON
files of a model directory, so a GGUF checkpoint is validated by the same code.
"""

from __future__ import annotations

from typing import Any

from pipellm.shared.gguf.reader import GGUFError, GGUFFile

# GGUF architecture -> (HF architecture, whether llama.cpp permuted the Q/K rows for its RoPE:
# only for `llama`, which it runs with interleaved RoPE; the others run NeoX, HF's rotate-half)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False), "phi3": ("Phi3ForCausalLM", False),
                 "qwen3moe": ("Qwen3MoeForCausalLM", False),
                 "gemma3": ("Gemma3ForCausalLM", False), "gemma2": ("Gemma2ForCausalLM", False),
                 "olmoe": ("OlmoeForCausalLM", False)}
# llama.cpp's Gemma defaults where a file lacks the key (llama-hparams.h; gemma3.cpp): attention
# and final-logit caps, and the layer count of the 27B models, whose attention scale is
# (hidden / heads) ** -0.5 rather than head_dim ** -0.5 (llama.cpp stores no scale)
_GEMMA_CAPS = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def architecture(gguf: GGUFFile) -> tuple[str, str, bool]:
    """(GGUF architecture name, HF architecture, Q/K permuted); GGUFError if unsupported."""
    arch = gguf.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf.path}: architecture {arch!r} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES)})")
    return (arch, *ARCHITECTURES[arch])


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The `config.json` of the checkpoint, from `{arch}.*` and `tokenizer.ggml.*` keys."""
    arch, hf_arch, _ = architecture(gguf)

    def key(name: str, default: Any = None) -> Any:
        value = gguf.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"{gguf.path}: metadata key '{arch}.{name}' is missing")
        return value

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    if "rope_freqs.weight" in gguf.tensors:
        raise GGUFError(f"{gguf.path}: per-frequency RoPE factors (rope_freqs, Llama 3.1-style "
                        "scaling) are not supported")
    tokens = gguf.require("tokenizer.ggml.tokens")
    fields = _arch_fields(gguf, arch, key("attention.key_length", hidden // heads))
    if arch == "llama" and "sliding_window" in fields:  # llama.cpp stores Mistral as `llama`
        hf_arch = "MistralForCausalLM"  # Llama's layers with a window on every one
    moe = _moe_fields(gguf, arch)
    if arch == "llama" and moe:  # and Mixtral as `llama` with experts (window or not)
        hf_arch = "MixtralForCausalLM"
    return {
        **fields,
        **moe,
        **_gemma_fields(gguf, arch, hidden, heads, key("block_count")),
        "architectures": [hf_arch],
        "vocab_size": gguf.get(f"{arch}.vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10_000.0),
        "rope_scaling": _rope_scaling(gguf, arch),
        "max_position_embeddings": key("context_length"),
        "hidden_act": "gelu_pytorch_tanh" if arch in _GEMMA_CAPS else "silu",
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "torch_dtype": "float32",  # weights are dequantized to float32 at load
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(gguf),
    }


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """The `tokenizer_config.json` fields the chat template uses: the template and the
    special-token strings."""
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    out: dict[str, Any] = {"chat_template": gguf.get("tokenizer.chat_template")}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        token_id = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            out[name] = tokens[token_id]
    return out


def _arch_fields(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    """The fields only some architectures' configs have: q/k/v biases (present as tensors),
    the attention window, and Phi-3's partial rotary and pre-training length."""
    out: dict[str, Any] = {"attention_bias": "blk.0.attn_q.bias" in gguf.tensors}
    window = gguf.get(f"{arch}.attention.sliding_window", 0)
    if window:
        out["sliding_window"] = window
    if arch == "phi3":
        rotary = gguf.get(f"{arch}.rope.dimension_count", head_dim)
        out["partial_rotary_factor"] = rotary / head_dim
        original = gguf.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            out["original_max_position_embeddings"] = original
    return out


def _gemma_fields(gguf: GGUFFile, arch: str, hidden: int, heads: int, layers: int
                  ) -> dict[str, Any]:
    """Gemma's config fields as llama.cpp reads its file: soft-caps, the attention scale, the
    sliding layers (`attention.sliding_window_pattern`: every n-th layer full, or a flag per
    layer) and Gemma 3's sliding-layer RoPE base ({} for other architectures)."""
    if arch not in _GEMMA_CAPS:
        return {}
    attn_cap, final_cap = _GEMMA_CAPS[arch]
    head_dim = gguf.get(f"{arch}.attention.key_length", hidden // heads)
    out: dict[str, Any] = {
        "attn_logit_softcapping": gguf.get(f"{arch}.attn_logit_softcapping", attn_cap),
        "final_logit_softcapping": gguf.get(f"{arch}.final_logit_softcapping", final_cap),
        "query_pre_attn_scalar": (hidden // heads if layers == _GEMMA_27B_LAYERS[arch]
                                  else head_dim),
        "rope_local_base_freq": gguf.get(f"{arch}.rope.freq_base_swa", 10_000.0),
    }
    pattern = gguf.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:
        out["sliding_window_pattern"] = pattern
    return out


def _moe_fields(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    """The experts' config fields ({} without `{arch}.expert_count`): Mixtral's experts are of
    feed_forward_length and always renormalized; OLMoE's of feed_forward_length, never
    renormalized (llama.cpp's olmoe graph); Qwen3-MoE's of expert_feed_forward_length,
    renormalized as `expert_weights_norm` says (llama.cpp runs qwen3moe renormalized)."""
    count = gguf.get(f"{arch}.expert_count")
    if not count:
        return {}
    used = gguf.get(f"{arch}.expert_used_count")
    if not used:
        raise GGUFError(f"{gguf.path}: metadata key '{arch}.expert_used_count' is missing")
    if arch == "llama":
        return {"num_local_experts": count, "num_experts_per_tok": used}
    if arch == "olmoe":
        return {"num_experts": count, "num_experts_per_tok": used, "norm_topk_prob": False}
    inter = gguf.get(f"{arch}.expert_feed_forward_length")
    if inter is None:
        raise GGUFError(f"{gguf.path}: metadata key '{arch}.expert_feed_forward_length' is "
                        "missing")
    return {"num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": inter,
            "norm_topk_prob": bool(gguf.get(f"{arch}.expert_weights_norm", True))}


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict | None:
    if arch == "phi3" and "rope_factors_long.weight" in gguf.tensors:
        return _longrope(gguf, arch)
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise GGUFError(f"{gguf.path}: RoPE scaling {kind!r} is not supported (none, linear)")
    return {"rope_type": "linear", "factor": gguf.require(f"{arch}.rope.scaling.factor")}


def _longrope(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp's converter stores it: the factors as the tensors
    rope_factors_{short,long}, the attention factor and pre-training length as metadata."""
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for kind in ("short", "long"):
        name = f"rope_factors_{kind}.weight"
        if name not in gguf.tensors:
            raise GGUFError(f"{gguf.path}: tensor '{name}' is missing (LongRoPE has both)")
        scaling[f"{kind}_factor"] = [float(v) for v in gguf.tensor(name).reshape(-1)]
    attention = gguf.get(f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def _eos_ids(gguf: GGUFFile) -> list[int]:
    """EOS plus end-of-turn (llama.cpp's `eot_token_id`, e.g. <|im_end|>): both end a reply."""
    ids = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return list(dict.fromkeys(i for i in ids if i is not None))
