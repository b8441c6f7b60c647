"""Simulated compute backend (`--backend sim`): the real scheduler and KV allocator, with the
KV capacity of a chosen GPU and model and step times from a roofline cost model.

- `hardware`: GPU and model specs; `cost`: the cost model; `runner`: `SimRunner` and the
  virtual clock; `roofline`: the table. Whole workloads on the virtual clock (what the
  ablation runs) are bench/virtual.py: benchmark code, not the server's.
- `model_config(config)`: the ModelConfig the engine runs with: vocabulary and EOS from the
  `--model` directory when one is given (the tokenizer the running stack uses), else from the
  simulated model; the context length always from the simulated model (Llama-3-8B: 8192).
"""

from __future__ import annotations

import dataclasses

from pipellm.services.compute.sim.hardware import ModelSpec, model
from pipellm.shared.config import EngineConfig
from pipellm.shared.model_config import ModelConfig


def model_config(config: EngineConfig) -> ModelConfig:
    spec = model(config.sim.model)
    if not config.model:
        return spec_model_config(spec)
    mc = ModelConfig.from_path(config.model)
    return dataclasses.replace(mc, max_position_embeddings=spec.context, sliding_window=None,
                               rope_scaling=None)


def spec_model_config(spec: ModelSpec) -> ModelConfig:
    """A ModelConfig with the spec's shape (the simulated engine reads vocab, EOS, context)."""
    return ModelConfig(
        architecture="Qwen2ForCausalLM" if spec.qkv_bias else "LlamaForCausalLM",
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_layers=spec.layers, num_heads=spec.heads, num_kv_heads=spec.kv_heads,
        head_dim=spec.head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=spec.context, tie_word_embeddings=spec.tie_embeddings,
        attention_bias=spec.qkv_bias, dtype="bfloat16", eos_token_ids=spec.eos_token_ids,
        bos_token_id=spec.bos_token_id, sliding_window=None,
    )


def check_config(config: EngineConfig) -> None:
    """Fail early (ValueError with the choices) on a bad --sim-* setting or a model that
    leaves no room for a KV cache on the GPU."""
    from pipellm.services.compute.sim.runner import cost_model

    cost = cost_model(config)
    if config.kv_cache_tokens <= 0:
        cost.kv_capacity_tokens(config.gpu_memory_utilization)
