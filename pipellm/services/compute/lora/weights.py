"""A LoRA adapter's factors (a PEFT directory, or a GGUF LoRA file: gguf_adapter.py), fused
the way the decoder fuses its projections.

PEFT stores, per targeted module, lora_A [r, in] and lora_B [out, r] under names like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. The decoder runs q/k/v as
one projection (and gate/up as one): an adapter's parts of a fused projection become one pair,
A = the parts' A stacked [k r, in] and B block-diagonal [out, k r] (a part not targeted is a
zero block, so its columns get no delta), then transposed for `LoraLinear` and scaled.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pipellm.services.compute.lora.gguf_adapter import hf_rows, read_gguf_factors
from pipellm.shared.gguf.reader import is_gguf
from pipellm.shared.lora import TARGETS, AdapterConfig, LoraError
from pipellm.shared.model_config import ModelConfig

_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def read_factors(path: str | Path) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, PEFT module name): {"A": [r, in], "B": [out, r]}} of the adapter at `path`
    (adapter_model.safetensors, else adapter_model.bin; or a GGUF LoRA file, its q/k B rows in
    llama.cpp's order where `AdapterConfig.llama_qk_rows`)."""
    if is_gguf(path):
        return read_gguf_factors(path)
    path = Path(path)
    file = path / "adapter_model.safetensors"
    if file.exists():
        from safetensors.torch import load_file

        tensors = load_file(str(file))
    elif (path / "adapter_model.bin").exists():
        tensors = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise LoraError(f"LoRA adapter {path}: no adapter_model.safetensors or .bin")
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.search(name)
        if m is None or m.group(2) not in TARGETS:
            raise LoraError(f"LoRA adapter {path}: tensor {name} is not a factor of a "
                            f"supported projection ({', '.join(TARGETS)})")
        factors.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    return factors


def part_sizes(cfg: ModelConfig) -> dict[str, list[int]]:
    """Output rows of each part of the decoder's fused projections."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {"qkv": [q, kv, kv], "o": [cfg.hidden_size], "gate_up": [inter, inter],
            "down": [cfg.hidden_size]}


def fuse(factors: dict[tuple[int, str], dict[str, torch.Tensor]], config: AdapterConfig,
         cfg: ModelConfig, layer: int, projection: str, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A^T [in, k r] in `dtype`, B * scaling [out, k r] in float32) of `projection` ("qkv",
    "o", "gate_up" or "down") of `layer`, k its parts (`part_sizes`), part j's factors in
    columns j r .. (j + 1) r (zeros for a part the adapter does not target), B's rows in HF's
    order of the fused output (the caller reorders them as the decoder does, then transposes);
    None where the adapter targets none of its parts."""
    sizes = part_sizes(cfg)[projection]
    names = [n for n, (p, _) in TARGETS.items() if p == projection]  # in part order
    present = [factors[layer, n] for n in names if (layer, n) in factors]
    if not present:
        return None
    r, k = config.rank, len(sizes)
    a = torch.zeros(k * r, present[0]["A"].shape[1])
    b = torch.zeros(sum(sizes), k * r)
    for j, name in enumerate(names):
        f = factors.get((layer, name))
        if f is None:
            continue
        if f["A"].shape != (r, a.shape[1]) or f["B"].shape != (sizes[j], r):
            raise LoraError(f"LoRA layer {layer} {projection}: factors {tuple(f['A'].shape)}, "
                            f"{tuple(f['B'].shape)} do not fit rank {r} and {sizes[j]} rows "
                            "(an adapter of another model?)")
        lo = sum(sizes[:j])
        a[j * r : (j + 1) * r] = f["A"].float()
        b[lo : lo + sizes[j], j * r : (j + 1) * r] = _hf_b(f["B"].float(), name, config, cfg)
    b *= config.scaling
    return a.t().contiguous().to(dtype), b


def _hf_b(b: torch.Tensor, name: str, config: AdapterConfig, cfg: ModelConfig) -> torch.Tensor:
    """B of PEFT module `name` with its rows in HF's order (llama.cpp's q/k order undone)."""
    if config.llama_qk_rows and name in ("q_proj", "k_proj"):
        return hf_rows(b, cfg.num_heads if name == "q_proj" else cfg.num_kv_heads)
    return b
