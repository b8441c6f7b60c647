"""Sampling defaults from the model: vLLM's --generation-config and --override-generation-config.

A request that leaves temperature, top_p, top_k, min_p, repetition_penalty or max_tokens unset
gets the model creator's value for it, resolved once at start-up (`GenerationDefaults.of`):

* `auto` (the default): the model directory's `generation_config.json`; for a GGUF file, its
  llama.cpp `general.sampling.*` metadata; for the default model (SmolLM2-135M-Instruct, whose
  GGUF carries none), the sampling its model card recommends, shipped as
  `smollm2_generation_config.json` next to this file.
* `vllm`: none; requests get the API's own defaults (temperature 1, no top-k/top-p/min-p, ...).
* a directory (or a file) holding a `generation_config.json`: that one.

`--override-generation-config '{"temperature": 0.5}'` overrides or adds keys, whatever the mode.
As in vLLM: `max_new_tokens` is the default max_tokens; from a directory given to
--generation-config or from the override it is also a server-wide cap on max_tokens (a larger
requested max_tokens is lowered to it). `do_sample` is ignored as vLLM ignores it (a
generation_config.json with do_sample false but a temperature samples at that temperature), and
so is every other key (listed in `ignored` and in the start-up line). A missing file, malformed
JSON or an invalid value raises ValueError naming where it came from.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipellm.shared.config_fields import read_json
from pipellm.shared.sampling import InvalidParams, SamplingParams

FILE_NAME = "generation_config.json"
DEFAULT_MODEL_FILE = Path(__file__).with_name("smollm2_generation_config.json")
MODES = ("auto", "vllm")  # or a path

# generation_config.json key -> SamplingParams field (HF's max_new_tokens is vLLM's max_tokens)
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INTS = frozenset({"top_k", "max_tokens"})
# llama.cpp's GGUF keys (gguf.Keys.General.SAMPLING_*) -> the generation_config.json key
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
              "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
# generation_config.json keys that are not sampling settings (the token ids are read with the
# model's config): not reported as ignored
_NOT_SAMPLING = frozenset({"_from_model_config", "transformers_version", "bos_token_id",
                           "eos_token_id", "pad_token_id", "decoder_start_token_id"})
# what a request gets for a field neither it nor the model sets (OpenAI's and vLLM's defaults;
# top_k 0 and min_p 0: off)
API_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults requests get; None: the API's (`API_DEFAULTS`, and for max_tokens
    what the endpoint does without one)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # when a request gives none (HF's max_new_tokens)
    max_tokens_limit: int | None = None  # a requested max_tokens is lowered to this
    source: str = ""  # where they come from, for the start-up line
    ignored: tuple[str, ...] = ()  # keys found but not used

    @classmethod
    def of(cls, config) -> GenerationDefaults:
        """The defaults of an EngineConfig (its model, --generation-config and
        --override-generation-config)."""
        return cls.load(config.model, config.generation_config,
                        config.override_generation_config)

    @classmethod
    def load(cls, model_path: str | Path, mode: str = "auto",
             override_json: str | None = None) -> GenerationDefaults:
        """Resolve the defaults as vLLM does (module docstring); ValueError when they cannot be."""
        override = parse_override(override_json)
        if mode == "vllm":
            layers = []
        elif mode == "auto":
            layers = _from_model(Path(model_path))
        elif mode:
            path = Path(mode).expanduser()
            file = path / FILE_NAME if path.is_dir() else path
            if not file.is_file():
                raise ValueError(f"--generation-config {mode}: no {FILE_NAME} there (give auto, "
                                 "vllm, or a directory holding a generation_config.json)")
            layers = [(str(file), read_json(file, ValueError, f"--generation-config {mode}:"))]
        else:
            raise ValueError("--generation-config must be auto, vllm or a directory")
        if override:
            layers.append(("--override-generation-config", override))
        values, ignored, sources = {}, set(), []
        for source, found in layers:  # later layers win
            used = False
            for key, value in found.items():
                if key in _KEYS:
                    if value is not None:  # null: unset (vLLM skips None values)
                        values[_KEYS[key]] = _number(key, value, _KEYS[key] in _INTS, source)
                        used = True
                elif key not in _NOT_SAMPLING:
                    ignored.add(key)
            if used:
                sources.append(source)
        # vLLM: max_new_tokens caps every request when it comes from a --generation-config
        # directory or from the override (its "server-wide limit"), not from the model's own file
        from_override = override.get("max_new_tokens") is not None
        cap = values.get("max_tokens") if mode not in MODES or from_override else None
        if not sources:
            sources = ["--generation-config vllm" if mode == "vllm" else "none found"]
        defaults = cls(**values, max_tokens_limit=cap, source=" + ".join(sources),
                       ignored=tuple(sorted(ignored)))
        defaults._check()
        return defaults

    def apply(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A request's sampling fields (temperature, top_p, top_k, min_p, repetition_penalty;
        None where the request left one unset) with each unset one set: to the model's
        default, else the API's. A field the request sets is kept."""
        out = {}
        for name, value in fields.items():
            if value is None:
                value = getattr(self, name)
            out[name] = API_DEFAULTS[name] if value is None else value
        return out

    def max_tokens_for(self, requested: int | None, fallback: int | None) -> int | None:
        """max_tokens of a request that asked for `requested` (None: none): that, else the
        model's default, else `fallback` (the endpoint's; None: up to the context); lowered to
        the cap, if any."""
        value = requested if requested is not None else (
            self.max_tokens if self.max_tokens is not None else fallback)
        if self.max_tokens_limit is None:
            return value
        return min(value or self.max_tokens_limit, self.max_tokens_limit)

    @property
    def values(self) -> dict[str, Any]:
        """The defaults that are set, by SamplingParams field name."""
        return {k: v for k in (*API_DEFAULTS, "max_tokens")
                if (v := getattr(self, k)) is not None}

    def describe(self) -> str:
        """One line for the start-up log: which defaults apply, and from where."""
        ignored = f"; keys ignored: {', '.join(self.ignored)}" if self.ignored else ""
        if not self.values:
            return (f"sampling defaults: none from the model ({self.source}): requests that "
                    "leave them unset get the API's (temperature 1.0, no top-k/top-p/min-p)"
                    + ignored)
        shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
        cap = "" if self.max_tokens_limit is None else (
            f"; max_tokens capped at {self.max_tokens_limit}")
        return (f"sampling defaults for requests that leave them unset: {shown}{cap}, from "
                f"{self.source} (--generation-config vllm: none){ignored}")

    def _check(self) -> None:
        """ValueError unless the values are valid sampling parameters."""
        try:
            SamplingParams(**{"max_tokens": 1, **self.values})
        except InvalidParams as exc:
            name = next((k for k, f in _KEYS.items() if f == exc.param), exc.param)
            message = str(exc).replace("max_tokens", name)
            raise ValueError(f"sampling defaults from {self.source}: {message}") from None


def parse_override(text: str | None) -> dict[str, Any]:
    """--override-generation-config: a JSON object (empty or unset: {})."""
    if not text or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config is not valid JSON ({exc}): "
                         f"{text[:80]!r}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object such as "
                         f"'{{\"temperature\": 0.5}}', not {text[:80]!r}")
    return value


def is_default_model(model_path: str | Path) -> bool:
    """Whether `model_path` is the default model's GGUF file (pipellm/shared/default_model.py)."""
    from pipellm.shared import default_model

    return Path(model_path).name == default_model.FILE_NAME


def _from_model(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """`auto`: the model's own defaults, as (where, keys) layers, the last winning."""
    from pipellm.shared.gguf.reader import GGUFError, is_gguf, open_gguf

    if path.is_dir():
        file = path / FILE_NAME
        return [(str(file), read_json(file, ValueError, "the model's"))] if file.is_file() else []
    if not is_gguf(path):
        return []
    layers = []
    if is_default_model(path):
        layers.append((f"the SmolLM2-135M-Instruct model card, shipped as pipellm/shared/"
                       f"{DEFAULT_MODEL_FILE.name}",
                       read_json(DEFAULT_MODEL_FILE, ValueError, "pipellm's")))
    try:
        meta = open_gguf(path).metadata
    except GGUFError as exc:
        raise ValueError(str(exc)) from None
    gguf = {key: meta[k] for k, key in _GGUF_KEYS.items() if k in meta}
    gguf = {k: round(v, 6) if isinstance(v, float) else v for k, v in gguf.items()}  # float32
    ignored = {k.removeprefix("general.sampling."): v for k, v in meta.items()
               if k.startswith("general.sampling.") and k not in _GGUF_KEYS}
    if gguf or ignored:
        layers.append((f"{path.name}'s general.sampling.* metadata", {**ignored, **gguf}))
    return layers


def _number(key: str, value: Any, integer: bool, source: str) -> int | float:
    """A JSON number as the field's type; ValueError naming the key otherwise."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"sampling defaults from {source}: {key} must be {kind}, "
                         f"got {value!r}"[:300])
    return int(value) if integer else float(value)

