"""LoRA adapters as served: `--lora-modules` parsed into `LoraModule`s, and an adapter's
settings read into an `AdapterConfig` (shared: the settings check ranks at start-up, the
gateway lists the names, compute loads the weights). An adapter is a PEFT directory
(`adapter_config.json`) or a GGUF LoRA file as llama.cpp's `convert_lora_to_gguf.py` writes it
(`general.type` "adapter", `adapter.type` "lora", `adapter.lora.alpha`, tensors
`blk.N.<matrix>.weight.lora_a` / `.lora_b`).

`--lora-modules` takes vLLM's forms, separated by whitespace: `name=path`, or a JSON object
`{"name": ..., "path": ..., "base_model_name": ...}`; a JSON list of such objects also works.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

# PEFT's module names -> (the decoder's fused projection, the part of its output rows): a
# part an adapter does not target gets no delta
TARGETS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
# llama.cpp's names of the matrices of TARGETS (blk.N.<name>.weight)
GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
                "ffn_down": "down_proj"}
_GGUF_FACTOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


class LoraError(ValueError):
    """An adapter that cannot be served (a bad directory, an unsupported option, a rank over
    --max-lora-rank)."""


@dataclass(frozen=True)
class LoraModule:
    """One adapter as --lora-modules names it: requests pick it by `name`."""

    name: str
    path: str
    base_model_name: str = ""  # empty: the served model


@dataclass(frozen=True)
class AdapterConfig:
    """What a PEFT adapter_config.json (or a GGUF LoRA file's metadata and tensor shapes) says
    of a LoRA adapter. Invariant: rank >= 1 and every target in `TARGETS`; the delta of a
    target is x @ A^T @ B^T * scaling."""

    rank: int
    alpha: float
    use_rslora: bool
    targets: frozenset[str]  # PEFT module names (q_proj, ..., down_proj)
    # B rows of q_proj and k_proj in llama.cpp's order (each head's rotate-half pairs
    # interleaved: a GGUF file of architecture `llama`); the fusing restores HF's order
    llama_qk_rows: bool = False

    @property
    def scaling(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's rule)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def read(cls, path: str | Path) -> AdapterConfig:
        """The config of the PEFT directory or GGUF LoRA file `path`; LoraError where it is
        not one pipellm serves."""
        from pipellm.shared.gguf.reader import is_gguf

        if is_gguf(path):
            return _gguf_config(path)
        if Path(path).is_file():
            raise LoraError(f"LoRA adapter {path}: neither a PEFT directory nor a GGUF file")
        file = Path(path) / "adapter_config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise LoraError(f"LoRA adapter {path}: cannot read {file.name}: {exc}") from exc
        if raw.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"LoRA adapter {path}: peft_type {raw['peft_type']} is not LORA")
        for option in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save",
                       "fan_in_fan_out"):
            if raw.get(option):
                raise LoraError(f"LoRA adapter {path}: {option} is not supported")
        rank = int(raw.get("r", 8))
        targets = _targets(raw.get("target_modules"), path)
        if rank < 1:
            raise LoraError(f"LoRA adapter {path}: rank must be >= 1, not {rank}")
        return cls(rank=rank, alpha=float(raw.get("lora_alpha", 8)),
                   use_rslora=bool(raw.get("use_rslora", False)), targets=targets)


def _targets(spec, path) -> frozenset[str]:
    """target_modules (a list of module names, or PEFT's regex over full module names) as
    the names of TARGETS it covers; LoraError for a target that is none of them."""
    if isinstance(spec, str):
        if spec == "all-linear":
            return frozenset(TARGETS)
        return frozenset(n for n in TARGETS
                         if re.fullmatch(spec, f"model.layers.0.self_attn.{n}")
                         or re.fullmatch(spec, f"model.layers.0.mlp.{n}"))
    names = frozenset(spec or ())
    unknown = names - set(TARGETS)
    if unknown or not names:
        raise LoraError(f"LoRA adapter {path}: target modules {sorted(unknown) or '(none)'} "
                        f"are not supported (only {', '.join(TARGETS)})")
    return names


def open_gguf_adapter(path: str | Path):
    """The parsed GGUF file `path` (pipellm.shared.gguf.reader.GGUFFile) once checked to be a LoRA
    adapter pipellm serves: LoraError for another GGUF file (a model), an unknown
    architecture, an activated LoRA (aLoRA) or tensors of a type it cannot dequantize."""
    from pipellm.shared.gguf.hf import ARCHITECTURES
    from pipellm.shared.gguf.reader import GGUFError, open_gguf

    try:
        gguf = open_gguf(path)
        gguf.check_types()
    except (GGUFError, OSError) as exc:
        raise LoraError(f"LoRA adapter {path}: {exc}") from None
    kind = (gguf.get("general.type"), gguf.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise LoraError(f"LoRA adapter {path}: a GGUF file that is not a LoRA adapter "
                        f"(general.type {kind[0]!r}, adapter.type {kind[1]!r}; a model file?)")
    arch = gguf.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise LoraError(f"LoRA adapter {path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    if gguf.get("adapter.alora.invocation_tokens"):
        raise LoraError(f"LoRA adapter {path}: activated LoRA (aLoRA) is not supported")
    return gguf


def gguf_factor(name: str, path: str | Path) -> tuple[int, str, str]:
    """(layer, PEFT module name, "A" or "B") of a GGUF LoRA tensor `blk.N.attn_q.weight.lora_a`;
    LoraError for any other tensor (norms, embeddings, a projection outside TARGETS)."""
    m = _GGUF_FACTOR.fullmatch(name)
    if m is None or m.group(2) not in GGUF_TARGETS:
        raise LoraError(f"LoRA adapter {path}: tensor {name} is not a factor of a supported "
                        f"projection ({', '.join(GGUF_TARGETS)})")
    return int(m.group(1)), GGUF_TARGETS[m.group(2)], m.group(3).upper()


def _gguf_config(path: str | Path) -> AdapterConfig:
    """A GGUF LoRA file's config: the rank from its tensors' shapes (one for all), alpha from
    adapter.lora.alpha (absent or 0: llama.cpp's scale 1, i.e. alpha = rank), no rsLoRA (GGUF
    has no such key), the targets the modules present."""
    from pipellm.shared.gguf.hf import ARCHITECTURES

    gguf = open_gguf_adapter(path)
    ranks, targets = set(), set()
    for name, info in gguf.tensors.items():
        _, module, factor = gguf_factor(name, path)
        targets.add(module)
        ranks.add(info.shape[0] if factor == "A" else info.shape[-1])
    if len(ranks) != 1:
        raise LoraError(f"LoRA adapter {path}: ranks {sorted(ranks) or '(no factors)'}: one "
                        "rank for every factor is supported")
    rank = ranks.pop()
    if rank < 1:
        raise LoraError(f"LoRA adapter {path}: rank must be >= 1, not {rank}")
    alpha = float(gguf.get("adapter.lora.alpha") or rank)
    permuted = ARCHITECTURES[gguf.get("general.architecture")][1]
    return AdapterConfig(rank=rank, alpha=alpha, use_rslora=False, targets=frozenset(targets),
                         llama_qk_rows=permuted)


def parse_lora_modules(text: str) -> list[LoraModule]:
    """--lora-modules' value as LoraModules, in order; ValueError on a malformed one or a name
    given twice."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        items = json.loads(text)
    else:
        items = [json.loads(t) if t.startswith("{") else t for t in _split(text)]
    modules = []
    for item in items:
        if isinstance(item, dict):
            if not item.get("name") or not item.get("path"):
                raise ValueError(f"--lora-modules: {item} needs a name and a path")
            modules.append(LoraModule(str(item["name"]), str(item["path"]),
                                      str(item.get("base_model_name") or "")))
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not name=path")
            modules.append(LoraModule(name, path))
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name is given twice: {names}")
    return modules


def _split(text: str) -> list[str]:
    """Whitespace-separated items, a JSON object kept whole."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "{") - (ch == "}")
        if ch.isspace() and depth == 0:
            if cur:
                items.append(cur)
            cur = ""
        else:
            cur += ch
    return items + [cur] if cur else items


def check_adapters(modules: list[LoraModule], max_cpu_loras: int | None,
                   max_lora_rank: int) -> None:
    """Start-up's check of --lora-modules against --max-cpu-loras and --max-lora-rank:
    LoraError naming the first adapter that does not fit."""
    if max_cpu_loras is not None and len(modules) > max_cpu_loras:
        raise LoraError(f"--lora-modules names {len(modules)} adapters; --max-cpu-loras is "
                        f"{max_cpu_loras}")
    for m in modules:
        rank = AdapterConfig.read(m.path).rank
        if rank > max_lora_rank:
            raise LoraError(f"LoRA adapter {m.name!r} ({m.path}) has rank {rank}, over "
                            f"--max-lora-rank {max_lora_rank}")


def adapter_scope(model_key: str, lora_name: str) -> str:
    """The key statistics learned of a model's outputs are kept under (the length
    predictor's features): the model's, or for an adapter's requests, the model's and its."""
    return f"{model_key}\x1flora:{lora_name}" if lora_name else model_key


def runtime_adapters(client, server: str) -> list[LoraModule]:
    """The adapters loaded at run time on `server` (pipellm.shared.state.lora_key, a sync Redis
    client), in name order; [] where Redis does not answer."""
    import redis

    from pipellm.shared.state import decode_hash, lora_key

    try:
        loaded = decode_hash(client.hgetall(lora_key(server)))
    except redis.RedisError:
        return []
    return [LoraModule(name, path) for name, path in sorted(loaded.items())]
