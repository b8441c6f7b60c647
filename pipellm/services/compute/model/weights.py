"""Checkpoint tensors from a Hugging Face model directory (safetensors) or a GGUF file.

Layouts, in order of preference:
  1. `model.safetensors.index.json` (sharded checkpoint; its `weight_map` names the shards),
  2. `model.safetensors`,
  3. every `*.safetensors` file in the directory.
Tensors keep their Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...); fused
projections (Phi-3's `qkv_proj`, `gate_up_proj`) come split under Llama's names, and Gemma's
RMSNorm weights w as the (1 + w) they scale by, as llama.cpp's converter stores them in GGUF
(arch.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pipellm.services.compute.model.gguf_weights import load_gguf_weights
from pipellm.services.compute.model.progress import progress
from pipellm.shared.gguf.reader import is_gguf
from pipellm.shared.model_config import ModelConfig, ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
# A multimodal checkpoint's language model under the decoder's names (Gemma 3 4B+: the Hub's
# files `language_model.model.*`, transformers v5's `model.language_model.*`); the vision tower
# and projector are not read
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
SINGLE_FILE = "model.safetensors"
SKIP = object()  # load_weights' `take` answer for a tensor not to load at all
_UNSUPPORTED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def load_weights(
    path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
    keep_int4: bool = False, take=None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of the checkpoint in `path`, floating ones cast to `dtype`, on `device`.

    `path` may also be a GGUF file (see gguf_weights.py; `keep_int4` keeps its Q4_0/Q4_1
    matrices as Int4Weight). `take(name, tensor)`: of a safetensors tensor (a slice object:
    `get_shape()`, indexing), the part to keep, None for all of it, or SKIP for none (a
    tensor-parallel rank's shard: tp/shard.ShardReader); a GGUF file is read whole. Raises
    ModelLoadError when the directory has no safetensors, a shard is missing, or a file cannot
    be read.
    """
    if is_gguf(path):
        return _split_fused(path, load_gguf_weights(path, dtype, device, keep_int4))  # norms +1
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist or is not a directory")
    weights: dict[str, torch.Tensor] = {}
    files = _checkpoint_files(root)
    known = None if None in files.values() else sum(len(n) for n in files.values())
    tensors = (t for file, names in files.items() for t in _read_file(file, names, take))
    for name, tensor in progress(tensors, known, "weights (tensors)"):
        if name in weights:
            raise ModelLoadError(f"tensor '{name}' appears in more than one file in {root}")
        if tensor.is_floating_point():
            tensor = tensor.to(device=device, dtype=dtype)
        else:
            tensor = tensor.to(device=device)
        weights[name] = tensor
    return _split_fused(path, _fold_norm_offset(path, weights))


def _split_fused(path, weights: dict) -> dict:
    """Fused projections split under Llama's names (arch.split_fused), for every reader of the
    weights: the decoder and SmoothQuant's calibration."""
    if not any(n.endswith(("qkv_proj.weight", "gate_up_proj.weight")) for n in weights):
        return weights
    from pipellm.services.compute.model.arch import split_fused  # arch reads `require` from here

    return split_fused(ModelConfig.from_path(path), weights)


def _fold_norm_offset(path, weights: dict) -> dict:
    """Gemma's RMSNorm weights w (every `*norm.weight`) replaced by the (1 + w) they scale by,
    added in float32 as transformers adds them."""
    offset = ModelConfig.from_path(path).norm_weight_offset
    if offset:
        for name, w in weights.items():
            if name.endswith("norm.weight"):
                weights[name] = (w.float() + offset).to(w.dtype)
    return weights


def require(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Return `weights[name]`, or raise ModelLoadError naming the missing tensor."""
    try:
        return weights[name]
    except KeyError:
        raise ModelLoadError(
            f"checkpoint is missing tensor '{name}' ({len(weights)} tensors present); "
            "is the checkpoint complete and of the architecture named in config.json?"
        ) from None


def _checkpoint_files(root: Path) -> dict[Path, set[str] | None]:
    """Map each safetensors file to read onto the tensor names it must hold (None: all)."""
    index = root / INDEX_FILE
    if index.is_file():
        return _files_from_index(index)
    if (root / SINGLE_FILE).is_file():
        return {root / SINGLE_FILE: None}
    files = sorted(root.glob("*.safetensors"))
    if files:
        return dict.fromkeys(files)
    others = sorted(p.name for p in root.iterdir() if p.suffix in _UNSUPPORTED_SUFFIXES)
    if others:
        raise ModelLoadError(
            f"no *.safetensors files in {root}; found {', '.join(others)}, but PyTorch pickle "
            "checkpoints (.bin/.pt) are not supported: convert the checkpoint to safetensors"
        )
    raise ModelLoadError(f"no *.safetensors files in {root}: cannot load model weights")


def _files_from_index(index: Path) -> dict[Path, set[str]]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{index} is not valid JSON: {exc}") from exc
    except (KeyError, TypeError):
        raise ModelLoadError(f"{index} has no 'weight_map' object") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index}: 'weight_map' must be a non-empty object")
    files: dict[Path, set[str]] = {}
    for name, shard in weight_map.items():
        files.setdefault(index.parent / shard, set()).add(name)
    for shard in files:
        if not shard.is_file():
            raise ModelLoadError(
                f"shard {shard.name} listed in {index.name} is missing from {index.parent}"
            )
    return dict(sorted(files.items()))


def _text_name(name: str) -> str:
    """A multimodal checkpoint's language-model tensor name as the decoder's (others as is)."""
    for prefix, decoder in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return decoder + name.removeprefix(prefix)
    return name


def _read_file(file: Path, expected: set[str] | None, take=None):
    """Yield (name, tensor) for the tensors of one safetensors file, on CPU (`take`: see
    load_weights)."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names = set(handle.keys())
            missing = sorted((expected or set()) - names)
            if missing:
                raise ModelLoadError(
                    f"{file.name} lacks tensor '{missing[0]}' that {INDEX_FILE} places there"
                )
            for name in sorted(names):
                if not name.startswith(_VISION_PREFIXES):
                    part = None if take is None else take(_text_name(name),
                                                          handle.get_slice(name))
                    if part is SKIP:
                        continue
                    yield _text_name(name), handle.get_tensor(name) if part is None else part
    except ModelLoadError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc
