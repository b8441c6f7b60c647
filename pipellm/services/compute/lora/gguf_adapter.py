"""A GGUF LoRA file's factors (llama.cpp's `convert_lora_to_gguf.py` format) in PEFT's terms.

Per targeted matrix `blk.N.<name>.weight` the file holds `.lora_a`, numpy shape [r, in] (PEFT's
lora_A as it is), and `.lora_b`, [out, r] (PEFT's lora_B), in F32, F16, BF16 or Q8_0 (the
converter's --outtype; dequantized here to float32). In a file of architecture `llama` the
lora_b rows of attn_q and attn_k are permuted per head as llama.cpp permutes the base's q/k
weights; the file holds no head counts, so `hf_rows` restores HF's order where the model's
config is known (weights.fuse).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipellm.shared.lora import LoraError, gguf_factor, open_gguf_adapter


def read_gguf_factors(path: str | Path) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(layer, PEFT module name): {"A": [r, in], "B": [out, r]}} (float32) of the GGUF LoRA
    file `path`; LoraError for a file that is not one or a factor without its pair."""
    gguf = open_gguf_adapter(path)
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name in gguf.tensors:
        layer, module, factor = gguf_factor(name, path)
        factors.setdefault((layer, module), {})[factor] = torch.from_numpy(gguf.tensor(name))
    for (layer, module), pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {path}: layer {layer} {module} has lora_"
                            f"{next(iter(pair)).lower()} without its pair")
    return factors


def hf_rows(b: torch.Tensor, n_heads: int) -> torch.Tensor:
    """B [n_heads * head_dim, r] with llama.cpp's q/k row permutation undone (each head's rows
    (x0, y0, x1, y1, ...) back to HF's rotate-half halves (x0, x1, ..., y0, y1, ...))."""
    rows = b.shape[0]
    return (b.reshape(n_heads, rows // n_heads // 2, 2, *b.shape[1:])
            .transpose(1, 2).reshape(b.shape).contiguous())
