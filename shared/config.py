"""Settings: frozen dataclasses resolved once at start-up from CLI flags and env vars.

Every field `foo_bar` of a config class is the flag `--foo-bar` and the env var
`PIPELLM_FOO_BAR`; precedence: flag > env var > default. This is the only place that reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""  # local HF model directory; empty: the built-in demo model
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (the checkpoint's) | float32 | bfloat16 | float16
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_batched_tokens: int = 512  # tokens per merged step
    max_running: int = 256  # requests in the running batch
    kv_cache_tokens: int = 0  # KV slots; 0: sized from memory (see below)
    kv_cache_gib: float = 1.0  # CPU: KV cache size when kv_cache_tokens is 0
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of total memory for weights + KV
    kv_policy: str = "predicted"  # predicted | max
    default_predicted_len: int = 128  # predicted output length until the predictor knows better
    kv_min_grow: int = 16  # minimum growth of a KV segment that ran out

    def __post_init__(self):
        if self.kv_policy not in ("predicted", "max"):
            raise ValueError(f"--kv-policy must be predicted or max, not {self.kv_policy!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16: {self.dtype!r}")
        if self.default_predicted_len < 1:
            raise ValueError("--default-predicted-len must be at least 1")


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of the dataclass `cls`, defaulting to its env var or field default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = _base_type(hints[f.name])
        env = os.environ.get(_env_name(f.name))
        default = f.default if env is None else _parse(typ, env)
        flag = "--" + f.name.replace("_", "-")
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=typ, default=default)


def config_from_args(cls: type, args: argparse.Namespace, **overrides):
    """Build the frozen config `cls` from parsed flags (and explicit overrides)."""
    names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name)]
    values = {n: getattr(args, n) for n in names}
    return cls(**{**values, **overrides})


def _env_name(field_name: str) -> str:
    return "PIPELLM_" + field_name.upper()


def _base_type(hint) -> type:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _parse(typ: type, text: str):
    if typ is bool:
        return text.strip().lower() in ("1", "true", "yes", "on")
    return typ(text)
