"""A model's config.json as typed fields: each read checked, each error a `ModelLoadError` naming
the file and the field (pipellm/shared/model_config.py and its model_config_* and layer_types
parts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """A model directory cannot be served; the message names the file, field or architecture."""


class ConfigFields:
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


def read_json(path: Path, error: type[Exception] = ModelLoadError,
              whose: str = "") -> dict[str, Any]:
    """A JSON file holding an object; `error` (naming `whose` file, then its path) otherwise."""
    name = f"{whose} {path}" if whose else str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{name} must hold a JSON object, got {type(data).__name__}")
    return data
