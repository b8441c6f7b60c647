"""RoPE fields of a model config (pipellm/shared/model_config.py): theta, the scaling type and its
parameters (linear, llama3, Phi-3's LongRoPE), and the partial rotary factor, from the v5
`rope_parameters` or the v4 `rope_scaling` layout. Errors name the file and field
(`ModelLoadError` through `ConfigFields.error`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipellm.shared.config_fields import ConfigFields
from pipellm.shared.model_config_gemma import GEMMA3, GEMMA3_ROPE_THETA, full_rope_params

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_ROPE_ALIASES = {"su": "longrope"}  # early Phi-3 configs
# The architecture whose transformers implementation takes LongRoPE and a partial rotary factor.
PHI3 = "Phi3ForCausalLM"
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


def rope(f: ConfigFields, arch: str, max_pos: int, head_dim: int
         ) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from v5 `rope_parameters` or v4
    `rope_scaling` (and top-level fields)."""
    params = f.cfg.get("rope_parameters")
    if params is None:
        params = f.cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise f.error(f"rope parameters must be a JSON object, got {params!r}")
    params = dict(params or {})
    if any(isinstance(v, dict) for v in params.values()):
        if arch != GEMMA3:
            raise f.error(f"per-layer-type rope_parameters are not supported for {arch} (only "
                          f"for {GEMMA3})")
        params = full_rope_params(f, params)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    params.pop("type", None)
    # rope_theta inside the rope dict (v5) wins over the top-level field (v4).
    default = GEMMA3_ROPE_THETA if arch == GEMMA3 else _DEFAULT_ROPE_THETA
    top_level_theta = f.get_float("rope_theta", default)
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


def _partial_rotary(f: ConfigFields, arch: str, value: Any, head_dim: int) -> float:
    """The fraction of each head RoPE turns: the rope dict's, else the top-level field's."""
    if value is None:
        value = f.cfg.get("partial_rotary_factor", 1.0)
    if value == 1:
        return 1.0
    if arch != PHI3:
        raise f.error(f"partial_rotary_factor != 1 is not supported for {arch} (only for {PHI3})")
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
    f: ConfigFields, arch: str, params: dict[str, Any], max_pos: int, rotary_dim: int
) -> dict[str, Any]:
    """Phi-3's LongRoPE: per-frequency short and long factors (which one the model applies is
    decided in pipellm/services/compute/model/rope.py), and the attention factor that scales
    cos/sin, as transformers' `_compute_longrope_parameters` computes it. Numbers are rounded to
    float32, as transformers applies them."""
    if arch != PHI3:
        raise f.error(f"rope type 'longrope' is not supported for {arch} (only for {PHI3})")
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
