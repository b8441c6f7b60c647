"""Which layers of a model attend through a sliding window, read from its config as transformers
reads it (pipellm/shared/model_config.py calls `sliding_window`).

- Llama: never.
- Mistral, Phi-3: every layer, when `sliding_window` is set (transformers' MistralModel and
  Phi3Model build one sliding mask for all layers).
- Qwen2, Qwen3: only with `use_sliding_window`; then the layers `layer_types` names
  "sliding_attention", or, without `layer_types`, the layers from `max_window_layers` on
  (Qwen2Config.__post_init__; its default is 28).
- Gemma 2, Gemma 3: the layers `layer_types` names, or, without it, all but every n-th
  (`sliding_window_pattern`, Gemma 3's default 6; Gemma 2: every other layer slides).

A window w means: the query at position p attends the keys at positions (p - w, p]
(transformers' `sliding_window_overlay`: kv_idx > q_idx - w, on the causal mask).
"""

from __future__ import annotations

from pipellm.shared.config_fields import ConfigFields
from pipellm.shared.model_config_gemma import SLIDING_PATTERN

FULL, SLIDING = "full_attention", "sliding_attention"
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
_QWEN_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config's default


def sliding_window(f: ConfigFields, arch: str, num_layers: int
                   ) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, layer_types): the window of the sliding layers (None: no layer slides) and, when
    only some layers slide, each layer's type (FULL or SLIDING); None when all layers agree."""
    if arch == "LlamaForCausalLM":
        return None, None
    if arch in _QWEN and not f.get_bool("use_sliding_window", False):
        return None, None
    window = f.get_int("sliding_window")
    if window is None:
        return None, None
    if arch in SLIDING_PATTERN:
        types = _layer_types(f, num_layers) or _gemma_layer_types(f, arch, num_layers)
    elif arch not in _QWEN:  # Mistral, Phi-3: one window for every layer
        return window, None
    else:
        types = _layer_types(f, num_layers) or _qwen_layer_types(f, num_layers)
    if SLIDING not in types:
        return None, None
    return window, None if FULL not in types else types


def _qwen_layer_types(f: ConfigFields, num_layers: int) -> tuple[str, ...]:
    """SLIDING from layer `max_window_layers` on."""
    first = f.cfg.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS)
    if first is None:
        first = _QWEN_MAX_WINDOW_LAYERS
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise f.error(f"field 'max_window_layers' must be an integer >= 0, got {first!r}")
    return tuple(SLIDING if i >= first else FULL for i in range(num_layers))


def _gemma_layer_types(f: ConfigFields, arch: str, num_layers: int) -> tuple[str, ...]:
    """FULL on every n-th layer (n: `sliding_window_pattern`), SLIDING on the others."""
    n = f.get_int("sliding_window_pattern", SLIDING_PATTERN[arch])
    return tuple(FULL if (i + 1) % n == 0 else SLIDING for i in range(num_layers))


def _layer_types(f: ConfigFields, num_layers: int) -> tuple[str, ...] | None:
    """`layer_types` (validated: one of FULL, SLIDING per layer), None when absent."""
    types = f.cfg.get("layer_types")
    if types is None:
        return None
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in (FULL, SLIDING) for t in types)):
        raise f.error(f"field 'layer_types' must list {FULL!r} or {SLIDING!r} for each of the "
                      f"{num_layers} layers, got {types!r}")
    return tuple(types)
