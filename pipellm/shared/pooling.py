"""How an embedding model pools: the sentence-transformers config of a model directory.

`PoolingConfig.from_dir` reads `modules.json` (the module list: a `Pooling` module, an optional
`Normalize` one) and the pooling module's `config.json` (`pooling_mode_lasttoken` / `_mean` /
`_cls_token`). Invariants: `mode` is one of MODES; `dimension` is the model's full embedding width
when known (0: unknown); `matryoshka_dims` lists the widths `dimensions` may truncate to (empty:
any width in 1..dimension). A directory without `modules.json` pools by the last token and
normalizes (Qwen3-Embedding's and vLLM's default for decoder embedders). `from_gguf` reads a
GGUF file's `{arch}.pooling_type` as llama.cpp does (mean, cls or last; absent or none: last)
and normalizes (llama.cpp's default for /v1/embeddings). `resolve` is what a server uses:
either, then vLLM's `--pooler-config` JSON (`pooling_type`, `normalize` or its newer name
`use_activation`) over it. `prompts` are the model's named instruction prefixes (Cohere's
`input_type` picks one): `config.json`'s `task_instructions`, else the `prompts` of
`config_sentence_transformers.json` (what `SentenceTransformer.encode(prompt_name=...)` prepends).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from pipellm.shared.settings import json_object

MODES = ("last", "mean", "cls", "all")  # all: every token's row (--convert reward only)
# llama.cpp's enum llama_pooling_type -> a mode (0 none and 4 rank: no single vector; last)
_GGUF_MODES = {1: "mean", 2: "cls", 3: "last"}
# vLLM's --pooler-config pooling_type -> a mode
_VLLM_TYPES = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_cls_token": "cls"}
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    """One pooling mode, whether the pooled vector is L2-normalized, and its width limits."""

    mode: str = "last"
    normalize: bool = True
    dimension: int = 0
    matryoshka_dims: tuple[int, ...] = ()
    prompts: tuple[tuple[str, str], ...] = ()  # (name, prefix), in the config's order

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"pooling mode {self.mode!r}: expected one of {MODES}")

    @classmethod
    def from_dir(cls, path: str | Path) -> PoolingConfig:
        """The pooling of the model directory `path` (see the module docstring)."""
        path = Path(path)
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls(prompts=_prompts(path))
        modules = json.loads(modules_file.read_text())
        pooling = [m for m in modules if m.get("type") == _POOLING]
        if len(pooling) != 1:
            raise ValueError(f"{modules_file}: expected one {_POOLING} module, got {len(pooling)}")
        pool_cfg = json.loads((path / pooling[0]["path"] / "config.json").read_text())
        modes = [mode for key, mode in _MODE_KEYS.items() if pool_cfg.get(key)]
        if len(modes) != 1:
            on = sorted(k for k, v in pool_cfg.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"{path}: expected one of the modes {sorted(_MODE_KEYS)}, got {on}")
        dims = _matryoshka_dims(path)
        return cls(mode=modes[0], normalize=any(m.get("type") == _NORMALIZE for m in modules),
                   dimension=int(pool_cfg.get("word_embedding_dimension", 0)),
                   matryoshka_dims=dims, prompts=_prompts(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> PoolingConfig:
        """The pooling of the GGUF file `path` (see the module docstring)."""
        from pipellm.shared.gguf.reader import open_gguf

        f = open_gguf(path)
        arch = f.require("general.architecture")
        return cls(mode=_GGUF_MODES.get(int(f.get(f"{arch}.pooling_type", 0)), "last"),
                   dimension=int(f.get(f"{arch}.embedding_length", 0)))

    @classmethod
    def resolve(cls, model: str | Path, pooler_config: str = "") -> PoolingConfig:
        """A server's pooling: the model's (a GGUF file's or a directory's), then the fields
        of vLLM's --pooler-config JSON over it (ValueError for one it cannot serve)."""
        from pipellm.shared.gguf.reader import is_gguf

        base = cls.from_gguf(model) if is_gguf(model) else cls.from_dir(model)
        if not pooler_config:
            return base
        fields = json_object("--pooler-config", pooler_config)
        unknown = sorted(set(fields) - {"pooling_type", "normalize", "use_activation"})
        if unknown:
            raise ValueError("--pooler-config takes pooling_type and normalize (vLLM's newer "
                             f"name: use_activation); got {unknown}")
        kind = str(fields.get("pooling_type", "")).upper()
        if kind and kind not in _VLLM_TYPES:
            raise ValueError(f"--pooler-config pooling_type {kind!r}: expected one of "
                             f"{sorted(_VLLM_TYPES)}")
        normalize = fields.get("normalize", fields.get("use_activation", base.normalize))
        return replace(base, mode=_VLLM_TYPES.get(kind, base.mode), normalize=bool(normalize))

    def output_dim(self, dimensions: int | None) -> int | None:
        """The width a request for `dimensions` gets (None: the full width); ValueError when
        the model cannot give it."""
        if dimensions is None:
            return None
        if dimensions < 1 or (self.dimension and dimensions > self.dimension):
            raise ValueError(f"dimensions must be in 1..{self.dimension or 'hidden size'}, "
                             f"got {dimensions}")
        if self.matryoshka_dims and dimensions not in self.matryoshka_dims:
            raise ValueError(f"dimensions {dimensions} not supported; the model's Matryoshka "
                             f"widths are {list(self.matryoshka_dims)}")
        return dimensions


def _prompts(path: Path) -> tuple[tuple[str, str], ...]:
    """The named prefixes a model directory declares (see the module docstring)."""
    for name, key in (("config.json", "task_instructions"),
                      ("config_sentence_transformers.json", "prompts")):
        f = path / name
        found = json.loads(f.read_text()).get(key) if f.is_file() else None
        if isinstance(found, dict) and found:
            return tuple((str(k), v) for k, v in found.items() if isinstance(v, str))
    return ()


def _matryoshka_dims(path: Path) -> tuple[int, ...]:
    """The Matryoshka widths `config_sentence_transformers.json` or `config.json` declare
    (`matryoshka_dimensions`), if any."""
    for name in ("config_sentence_transformers.json", "config.json"):
        f = path / name
        if f.is_file():
            dims = json.loads(f.read_text()).get("matryoshka_dimensions")
            if dims:
                return tuple(sorted(int(d) for d in dims))
    return ()
