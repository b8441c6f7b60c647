"""Model hyper-parameters, parsed and validated from a Hugging Face model directory.

Reads `config.json` (transformers v4 or v5 layout) and, when present, `generation_config.json`.
Everything the serving stack needs about the model's shape comes from `ModelConfig`; anything we
cannot serve correctly (unknown architecture, activation, RoPE variant...) fails here with a
`ModelLoadError` that names the file and field, rather than producing wrong tokens later.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.gguf.hf import hf_config
from shared.gguf.reader import GGUFError, is_gguf, open_gguf

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ROPE_ALIASES = {"su": "longrope"}  # early Phi-3 configs
# Architectures whose transformers implementation takes LongRoPE and a partial rotary factor.
_PHI3 = "Phi3ForCausalLM"
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # sliding window only with use_sliding_window
# Fields each scaled RoPE type needs, beyond rope_type itself.
_ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}
_DEFAULT_ROPE_THETA = 10_000.0
_DEFAULT_RMS_NORM_EPS = 1e-6


class ModelLoadError(Exception):
    """A model directory cannot be served; the message names the file, field or architecture."""


@dataclass(frozen=True)
class ModelConfig:
    """Validated hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3,
    Phi-3)."""

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
    sliding_window: int | None
    qk_norm: bool = False  # an RMSNorm [head_dim] on every q and k head before RoPE (Qwen3)
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim * factor dims (Phi-4)

    @property
    def rotary_dim(self) -> int:
        """The dims of a head RoPE rotates (the first ones), as transformers rounds them."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """A model directory's config, or a GGUF file's (from its metadata)."""
        if is_gguf(path):
            try:
                return _build(_Fields(hf_config(open_gguf(path)), Path(path)), {})
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
        cfg = _read_json(cfg_path)
        gen_path = root / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        return _build(_Fields(cfg, cfg_path), gen)


class _Fields:
    """Typed access to config.json fields with errors naming the file and the field."""

    def __init__(self, cfg: dict[str, Any], path: Path):
        self.cfg = cfg
        self.path = path

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {message}")

    def get_int(
        self, key: str, default: int | None = None, *, required: bool = False
    ) -> int | None:
        value = self.cfg.get(key)
        if value is None:
            if required:
                raise self.error(f"required field '{key}' is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.error(f"field '{key}' must be a positive integer, got {value!r}")
        return value

    def get_float(self, key: str, default: float, source: dict | None = None) -> float:
        value = (self.cfg if source is None else source).get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.error(f"field '{key}' must be a positive number, got {value!r}")
        return float(value)

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field '{key}' must be true or false, got {value!r}")
        return value


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _build(f: _Fields, gen: dict[str, Any]) -> ModelConfig:
    arch = _architecture(f)
    if f.cfg.get("hidden_act", "silu") != "silu":
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
    rope_theta, rope_scaling, partial = _rope(f, arch, max_pos, head_dim)
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
        sliding_window=_sliding_window(f, arch, num_layers),
        qk_norm=arch == "Qwen3ForCausalLM",
        partial_rotary_factor=partial,
    )


def _attention_bias(f: _Fields, arch: str) -> bool:
    """Whether q, k, v have biases: always for Qwen2, never for Phi-3, else `attention_bias`."""
    if arch == _PHI3:
        return False
    return arch == "Qwen2ForCausalLM" or f.get_bool("attention_bias", False)


def _architecture(f: _Fields) -> str:
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
    if arch not in SUPPORTED_ARCHITECTURES:
        raise f.error(
            f"architecture {arch!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(f: _Fields, arch: str, max_pos: int, head_dim: int) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from v5 `rope_parameters` or v4
    `rope_scaling` (and top-level fields)."""
    params = f.cfg.get("rope_parameters")
    if params is None:
        params = f.cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise f.error(f"rope parameters must be a JSON object, got {params!r}")
    params = dict(params or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise f.error("per-layer-type rope_parameters are not supported")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    params.pop("type", None)
    # rope_theta inside the rope dict (v5) wins over the top-level field (v4).
    top_level_theta = f.get_float("rope_theta", _DEFAULT_ROPE_THETA)
    theta = f.get_float("rope_theta", top_level_theta, source=params)
    params.pop("rope_theta", None)
    partial = _partial_rotary(f, arch, params.pop("partial_rotary_factor", None), head_dim)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise f.error(
            f"rope type {rope_type!r} is not supported; "
            f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "longrope":
        return theta, _longrope(f, arch, params, max_pos, int(head_dim * partial)), partial
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_pos)
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for field in _ROPE_FIELDS[rope_type]:
        value = params.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise f.error(f"{rope_type} rope scaling needs a positive '{field}', got {value!r}")
        scaling[field] = value
    return theta, scaling, partial


def _partial_rotary(f: _Fields, arch: str, value: Any, head_dim: int) -> float:
    """The fraction of each head RoPE turns: the rope dict's, else the top-level field's."""
    if value is None:
        value = f.cfg.get("partial_rotary_factor", 1.0)
    if value == 1:
        return 1.0
    if arch != _PHI3:
        raise f.error(f"partial_rotary_factor != 1 is not supported for {arch} (only for {_PHI3})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise f.error(f"field 'partial_rotary_factor' must be in (0, 1], got {value!r}")
    rotary = int(head_dim * value)
    if rotary < 2 or rotary % 2:
        raise f.error(
            f"partial_rotary_factor {value!r} turns {rotary} of {head_dim} head dims; "
            "it must be an even number"
        )
    return float(value)


def _longrope(
    f: _Fields, arch: str, params: dict[str, Any], max_pos: int, rotary_dim: int
) -> dict[str, Any]:
    """Phi-3's LongRoPE: per-frequency short and long factors (which one the model applies is
    decided in services/compute/model/rope.py), and the attention factor that scales cos/sin,
    as transformers' `_compute_longrope_parameters` computes it. Numbers are rounded to
    float32, as transformers applies them."""
    if arch != _PHI3:
        raise f.error(f"rope type 'longrope' is not supported for {arch} (only for {_PHI3})")
    # Phi-3 keeps the pre-training length at the top level; transformers prefers that one.
    original = f.cfg.get("original_max_position_embeddings")
    if original is None:
        original = params.get("original_max_position_embeddings", max_pos)
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise f.error(
            f"field 'original_max_position_embeddings' must be a positive integer, got {original!r}"
        )
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for field in ("short_factor", "long_factor"):
        value = params.get(field)
        ok = isinstance(value, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value
        )
        if not ok or len(value) != rotary_dim // 2:
            raise f.error(
                f"longrope rope scaling needs '{field}': a list of {rotary_dim // 2} "
                f"positive numbers (rotary dims / 2), got {value!r}"
            )
        scaling[field] = [_f32(v) for v in value]
    factor = f.get_float("factor", max_pos / original, source=params)
    attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = f.get_float("attention_factor", attention, source=params)
    scaling["original_max_position_embeddings"] = original
    scaling["attention_factor"] = _f32(attention)
    return scaling


def _f32(value: float) -> float:
    return float(np.float32(value))


def _dtype(f: _Fields) -> str:
    raw = f.cfg.get("dtype") or f.cfg.get("torch_dtype") or "float32"
    name = str(raw).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise f.error(f"dtype {raw!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def _sliding_window(f: _Fields, arch: str, num_layers: int) -> int | None:
    """The attention window when the model really uses one, else None."""
    if arch == "LlamaForCausalLM":
        return None
    if arch in _QWEN and not f.cfg.get("use_sliding_window", False):
        return None
    window = f.get_int("sliding_window")
    if window is None or arch in ("MistralForCausalLM", _PHI3):
        return window
    layer_types = f.cfg.get("layer_types")
    if layer_types is None:
        first_sliding = f.cfg.get("max_window_layers")
        first_sliding = num_layers if first_sliding is None else first_sliding
        layer_types = [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    sliding = {t == "sliding_attention" for t in layer_types}
    if sliding == {False}:
        return None
    if sliding != {True}:
        raise f.error("a sliding window on only some layers (max_window_layers) is not supported")
    return window


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _first(value: Any) -> int | None:
    ids = _token_ids(value)
    return ids[0] if ids else None


def context_length(mc: ModelConfig, requested: int = 0) -> int:
    """Tokens a request may span: the model's limit (its sliding window, which is not
    implemented, if it has one), lowered to `requested` when that is set."""
    limit = mc.max_position_embeddings
    if mc.sliding_window:
        limit = min(limit, mc.sliding_window)
    return min(requested or limit, limit)


def served_context(config) -> int:
    """The context length the gateway and tokenizers enforce for an EngineConfig: its
    --max-model-len, which `pipellm` resolves at start-up to the one compute serves
    (services/compute/backend.resolve); when 0 (a config built in code), the model file's."""
    return config.max_model_len or context_length(ModelConfig.from_path(config.model))


def served_name(model: str) -> str:
    """The model's name in the API by default: its directory's or GGUF file's name."""
    return Path(model).name.removesuffix(".gguf")
