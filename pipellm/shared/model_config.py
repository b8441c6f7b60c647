"""Model hyper-parameters, parsed and validated from a Hugging Face model directory.

Reads `config.json` (transformers v4 or v5 layout) and, when present, `generation_config.json`.
Everything the serving stack needs about the model's shape comes from `ModelConfig`; anything we
cannot serve correctly (unknown architecture, activation, RoPE variant...) fails here with a
`ModelLoadError` that names the file and field, rather than producing wrong tokens later.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipellm.shared.config_fields import ConfigFields, ModelLoadError, read_json
from pipellm.shared.gguf.hf import hf_config
from pipellm.shared.gguf.reader import GGUFError, is_gguf, open_gguf
from pipellm.shared.layer_types import FULL, SLIDING, sliding_window
from pipellm.shared.model_config_gemma import (
    GEMMA3,
    GEMMA_ARCHITECTURES,
    gemma_activation,
    gemma_fields,
    text_config,
)
from pipellm.shared.model_config_moe import MOE_ARCHITECTURES, QWEN3_MOE, moe_fields, moe_window
from pipellm.shared.model_config_rope import PHI3, rope
from pipellm.shared.scoring import SEQ_CLS

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    *GEMMA_ARCHITECTURES,
    *MOE_ARCHITECTURES,
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    """Validated hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3,
    Phi-3, Gemma 2 and 3) or of its mixture-of-experts kin (Qwen3-MoE, Mixtral, OLMoE)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None  # the window of the sliding layers; None: no layer slides
    qk_norm: bool = False  # an RMSNorm [head_dim] on every q and k head before RoPE (Qwen3)
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim * factor dims (Phi-4)
    # Per layer "sliding_attention" or "full_attention" (transformers' `layer_types`) where the
    # layers differ; None: every layer slides when sliding_window is set, else none does.
    layer_types: tuple[str, ...] | None = None
    # Mixture of experts (pipellm/shared/model_config_moe.py; 0 experts: a dense model): the layers
    # in moe_layers run num_experts SwiGLU experts of moe_intermediate_size, each token the
    # num_experts_per_tok best by the router's softmax (renormalized with norm_topk_prob)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    qk_norm_full: bool = False  # an RMSNorm over the whole q and k projections (OLMoE)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip, clip] after the norms (OLMoE)
    # Gemma 2 / 3 (pipellm/shared/model_config_gemma.py); the defaults are Llama's
    hidden_act: str = "silu"  # the MLP's gate: "silu" or "gelu_pytorch_tanh"
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): folded in at load
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too
    embed_scale: float = 1.0  # embeddings multiplied by it (in the weights' dtype)
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5 (None: head_dim)
    attn_softcap: float = 0.0  # scores capped to cap * tanh(s / cap) (0: not capped)
    final_softcap: float = 0.0  # logits capped likewise
    local_rope_theta: float | None = None  # the sliding layers' own (unscaled) RoPE base

    @property
    def attention_scale(self) -> float:
        """The factor q . k is scaled by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the sparse experts (else a dense SwiGLU MLP)."""
        return layer in self.moe_layers

    @property
    def rotary_dim(self) -> int:
        """The dims of a head RoPE rotates (the first ones), as transformers rounds them."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int:
        """Layer `layer`'s attention window, 0 for full attention: with window w the query at
        position p attends the keys at positions (p - w, p] (transformers' sliding window)."""
        if not self.sliding_window:
            return 0
        if self.layer_types is None or self.layer_types[layer] == SLIDING:
            return self.sliding_window
        assert self.layer_types[layer] == FULL
        return 0

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """A model directory's config, or a GGUF file's (from its metadata)."""
        if is_gguf(path):
            try:
                return _build(ConfigFields(hf_config(open_gguf(path)), Path(path)), {})
            except GGUFError as exc:
                raise ModelLoadError(str(exc)) from None
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (+ optional `generation_config.json`); raise ModelLoadError."""
        root = Path(path)
        if not root.is_dir():
            raise ModelLoadError(f"model directory {root} does not exist or is not a directory")
        cfg_path = root / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{cfg_path} not found: a model directory needs a config.json")
        cfg = text_config(read_json(cfg_path))  # a multimodal model's language model
        gen_path = root / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else {}
        return _build(ConfigFields(cfg, cfg_path), gen)


def _build(f: ConfigFields, gen: dict[str, Any]) -> ModelConfig:
    arch = _architecture(f)
    if arch in GEMMA_ARCHITECTURES:
        gemma_activation(f)
    elif f.cfg.get("hidden_act", "silu") != "silu":
        raise f.error(f"hidden_act {f.cfg['hidden_act']!r} is not supported (only 'silu')")
    if f.cfg.get("quantization_config") is not None:
        raise f.error("quantized checkpoints (quantization_config) are not supported")
    if f.cfg.get("mlp_bias"):
        raise f.error("mlp_bias=true is not supported")
    hidden = f.get_int("hidden_size", required=True)
    num_heads = f.get_int("num_attention_heads", required=True)
    num_kv_heads = f.get_int("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise f.error(
            f"num_attention_heads ({num_heads}) must be a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    if f.cfg.get("head_dim") is None and hidden % num_heads:
        raise f.error(
            f"hidden_size ({hidden}) is not divisible by num_attention_heads ({num_heads})"
        )
    num_layers = f.get_int("num_hidden_layers", required=True)
    max_pos = f.get_int("max_position_embeddings", required=True)
    head_dim = f.get_int("head_dim", hidden // num_heads)
    rope_theta, rope_scaling, partial = rope(f, arch, max_pos, head_dim)
    window, layer_types = sliding_window(f, arch, num_layers)
    window = moe_window(f, arch, window)
    eos = _token_ids(f.cfg.get("eos_token_id")) + _token_ids(gen.get("eos_token_id"))
    bos = f.cfg.get("bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=f.get_int("vocab_size", required=True),
        hidden_size=hidden,
        intermediate_size=f.get_int("intermediate_size", required=True),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.get_float("rms_norm_eps", _DEFAULT_RMS_NORM_EPS),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=f.get_bool("tie_word_embeddings", False),
        attention_bias=_attention_bias(f, arch),
        dtype=_dtype(f),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=bos if isinstance(bos, int) else _first(gen.get("bos_token_id")),
        sliding_window=window,
        qk_norm=arch in ("Qwen3ForCausalLM", QWEN3_MOE, GEMMA3),
        partial_rotary_factor=partial,
        layer_types=layer_types,
        **moe_fields(f, arch, num_layers),
        **gemma_fields(f, arch, hidden),
    )


def _attention_bias(f: ConfigFields, arch: str) -> bool:
    """Whether q, k, v have biases: always for Qwen2, never for Phi-3, else `attention_bias`."""
    if arch == PHI3:
        return False
    return arch == "Qwen2ForCausalLM" or f.get_bool("attention_bias", False)


def _architecture(f: ConfigFields) -> str:
    archs = f.cfg.get("architectures")
    if archs:
        arch = archs[0] if isinstance(archs, list) else archs
    else:
        model_type = f.cfg.get("model_type")
        arch = _ARCH_BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
        if arch is None:
            raise f.error(
                f"no 'architectures' field and model_type {model_type!r} is not supported; "
                f"supported model types: {', '.join(_ARCH_BY_MODEL_TYPE)}"
            )
    if arch.endswith(SEQ_CLS) and arch.replace(SEQ_CLS, "ForCausalLM") in SUPPORTED_ARCHITECTURES:
        arch = arch.replace(SEQ_CLS, "ForCausalLM")  # its decoder; the head:
                                                     # pipellm/shared/scoring.py
    if arch not in SUPPORTED_ARCHITECTURES:
        raise f.error(
            f"architecture {arch!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _dtype(f: ConfigFields) -> str:
    raw = f.cfg.get("dtype") or f.cfg.get("torch_dtype") or "float32"
    name = str(raw).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise f.error(f"dtype {raw!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _first(value: Any) -> int | None:
    ids = _token_ids(value)
    return ids[0] if ids else None


def context_length(mc: ModelConfig, requested: int = 0) -> int:
    """Tokens a request may span: the model's max_position_embeddings (a sliding window does
    not cap it: those layers attend the window's keys), lowered to `requested` when set."""
    limit = mc.max_position_embeddings
    return min(requested or limit, limit)


def served_context(config) -> int:
    """The context length the gateway and tokenizers enforce for an EngineConfig: its
    --max-model-len, which `pipellm` resolves at start-up to the one compute serves
    (pipellm/services/compute/backend.resolve); when 0 (a config built in code), the model
    file's."""
    return config.max_model_len or context_length(ModelConfig.from_path(config.model))


def served_name(model: str) -> str:
    """The model's name in the API by default: its directory's or GGUF file's name."""
    return Path(model).name.removesuffix(".gguf")
