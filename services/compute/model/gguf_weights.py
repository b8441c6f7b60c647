"""Checkpoint tensors from a GGUF file, dequantized and renamed to Hugging Face names.

llama.cpp's converter stores, for the `llama` architecture, the rows of each Q and K projection
permuted from HF's rotate-half RoPE layout to its interleaved one: within every head, rows
(0, d/2, 1, d/2+1, ...). `_unpermute` undoes that, so the model runs with the same RoPE as for
a Hugging Face checkpoint.
"""

from __future__ import annotations

import torch

from services.compute.model.progress import progress
from shared.gguf.hf import architecture
from shared.gguf.reader import GGUFError, GGUFFile, open_gguf
from shared.model_config import ModelLoadError

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


def load_gguf_weights(path, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file at `path`, as float `dtype` on `device`, HF-named.

    Raises ModelLoadError naming the file and the tensor for unknown tensors or types."""
    try:
        gguf, names, heads = _check(path)
        return {name: _load(gguf, src, name, heads).to(device, dtype)
                for src, name in progress(names.items(), len(names), "weights (tensors)")}
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None


def check_gguf(path) -> None:
    """Raise ModelLoadError if the file's tensors cannot be loaded (names, types, truncation),
    without reading them: what `pipellm serve` checks before any service starts."""
    try:
        _check(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None


def _check(path) -> tuple[GGUFFile, dict[str, str], dict[str, int] | None]:
    """(file, GGUF -> HF tensor names, heads per permuted projection or None)."""
    gguf = open_gguf(path)
    arch, _, permuted = architecture(gguf)
    gguf.check_types()
    q_heads = gguf.require(f"{arch}.attention.head_count")
    heads = {"q_proj": q_heads, "k_proj": gguf.get(f"{arch}.attention.head_count_kv", q_heads)}
    return gguf, _names(gguf), heads if permuted else None


def _names(gguf: GGUFFile) -> dict[str, str]:
    names = {}
    for src in gguf.tensors:
        name = hf_name(src)
        if name is None:
            raise GGUFError(f"{gguf.path}: tensor '{src}' is not part of a Llama-family model")
        names[src] = name
    return names


def _load(gguf: GGUFFile, src: str, name: str, heads: dict | None) -> torch.Tensor:
    t = torch.from_numpy(gguf.tensor(src))
    if heads is not None:
        for proj, n_heads in heads.items():
            if f".{proj}." in name:
                t = _unpermute(t, n_heads)
    return t


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation. w: [n_heads * head_dim, ...] (a weight, or
    a bias of shape [n_heads * head_dim])."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())
