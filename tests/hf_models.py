"""Tiny random Hugging Face models saved to disk, as reference implementations for tests.

from tests.hf_models import build_hf_model
model = build_hf_model(tmp_path, "qwen2", num_key_value_heads=1, with_tokenizer=True)
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer

from pipellm.shared.demo_model import build_demo_tokenizer

ARCHES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
}
# Gemma: head_dim 32 != hidden / heads and the attention scale llama.cpp derives from it (GGUF
# stores none); a window of 16 on layers 0 and 2 of 3; Gemma 2's attention cap low enough to
# bite on a tiny random model (its real one is 50), its final-logit cap 30 as in Gemma 2
_GEMMA = {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}

DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "dtype": "float32",
}
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 32},  # != hidden / heads, as in Qwen3-0.6B (1024 / 16 vs 128)
    # Phi3Config's token ids are Phi-3's (32000): out of a tiny vocab
    "phi3": {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2},
    # mixtures of experts: 8 experts, top 2 (Mixtral's and OLMoE's of intermediate_size)
    "qwen3_moe": {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
              "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2},  # OLMoE's: 50279
    "gemma3": _GEMMA,
    "gemma2": {**_GEMMA, "attn_logit_softcapping": 1.0},
}


@functools.lru_cache(maxsize=1)
def demo_tokenizer() -> Tokenizer:
    """The demo model's tokenizer (built once per process)."""
    return build_demo_tokenizer()


def build_hf_model(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = False,
    **overrides: Any,
) -> transformers.PreTrainedModel:
    """Build a tiny random `arch` model (a key of ARCHES), save it to `path`.

    `overrides` are config fields (e.g. num_key_value_heads=1, initializer_range=0.2,
    rope_scaling={...}). `max_shard_size` (e.g. "100KB") saves a sharded checkpoint.
    `with_tokenizer` also writes the demo tokenizer.json and, unless overridden, sizes the vocab
    and BOS/EOS ids to it. Returns the model in eval mode, float32 on CPU.
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHES)}")
    config_cls, model_cls = ARCHES[arch]
    fields = {**DEFAULTS, **ARCH_DEFAULTS.get(arch, {})}
    if with_tokenizer:
        tok = demo_tokenizer()
        fields.update(
            vocab_size=tok.get_vocab_size(),
            bos_token_id=tok.token_to_id("<s>"),
            eos_token_id=tok.token_to_id("</s>"),
        )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    path = Path(path)
    # transformers v5 always writes safetensors (v4's safe_serialization flag is gone).
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    if with_tokenizer:
        demo_tokenizer().save(str(path / "tokenizer.json"))
    return model
