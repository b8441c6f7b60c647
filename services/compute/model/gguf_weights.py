"""Checkpoint tensors from a GGUF file, dequantized and renamed to Hugging Face names.

llama.cpp's converter stores, for the `llama` architecture, the rows of each Q and K projection
permuted from HF's rotate-half RoPE layout to its interleaved one: within every head, rows
(0, d/2, 1, d/2+1, ...). `_unpermute` undoes that, so the model runs with the same RoPE as for
a Hugging Face checkpoint. `qwen2`, `qwen3` and `phi3` run llama.cpp's NeoX (rotate-half) RoPE
and are stored unpermuted (shared/gguf/hf.py ARCHITECTURES).

Names follow gguf.constants.MODEL_TENSORS: what differs by architecture is Qwen3's per-head
`attn_q_norm`/`attn_k_norm` and Phi-3's fused `attn_qkv` and `ffn_up` (gate and up, fused);
Phi-3's `rope_factors_long`/`rope_factors_short` are RoPE parameters (read with the metadata,
shared/gguf/hf.py), not weights.

With `keep_int4`, the decoder's Q4_0/Q4_1 matrices are not dequantized: their blocks become an
`Int4Weight` (the same values, 4 bits each, an fp16 scale and min per 32), served by the INT4
GEMM. Block layout (ggml): Q4_1 = fp16 d, fp16 m, 16 bytes of nibbles; Q4_0 = fp16 d, 16 bytes;
nibble j of a block is value j (low nibbles) or j + 16 (high); value = q * d + m (Q4_0:
(q - 8) * d).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.int4_gemm import Int4Weight, pack_nibbles
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

_ARCH_LAYER = {"qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
               "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
NOT_WEIGHTS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight")}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` in a GGUF file of
    architecture `arch`; None if unknown."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".")
    layer = {**_LAYER, **_ARCH_LAYER.get(arch, {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    return None


def load_gguf_weights(path, dtype: torch.dtype, device,
                      keep_int4: bool = False) -> dict[str, torch.Tensor | Int4Weight]:
    """Every tensor of the GGUF file at `path`, as float `dtype` on `device`, HF-named; with
    `keep_int4`, decoder matrices stored as Q4_0/Q4_1 as Int4Weight instead.

    Raises ModelLoadError naming the file and the tensor for unknown tensors or types."""
    try:
        gguf, names, heads = _check(path)
        out = {}
        for src, name in progress(names.items(), len(names), "weights (tensors)"):
            if keep_int4 and src.startswith("blk.") and gguf.tensors[src].qtype.name in _Q4:
                out[name] = _permuted(_int4(gguf, src), name, heads).to(device, dtype)
            else:
                out[name] = _permuted(torch.from_numpy(gguf.tensor(src)), name, heads).to(
                    device, dtype)
        return out
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
    return gguf, _names(gguf, arch), heads if permuted else None


def _names(gguf: GGUFFile, arch: str) -> dict[str, str]:
    names = {}
    for src in gguf.tensors:
        if src in NOT_WEIGHTS.get(arch, ()):
            continue
        name = hf_name(src, arch)
        if name is None:
            raise GGUFError(f"{gguf.path}: tensor '{src}' is not part of a Llama-family model")
        names[src] = name
    return names


def _permuted(t, name: str, heads: dict | None):
    """t (a tensor or an Int4Weight, rows first) with llama.cpp's Q/K row order undone."""
    for proj, n_heads in (heads or {}).items():
        if f".{proj}." in name:
            if isinstance(t, Int4Weight):
                return Int4Weight(*(_unpermute(getattr(t, f), n_heads)
                                    for f in ("packed", "scales", "mins")), t.group_size)
            return _unpermute(t, n_heads)
    return t


_Q4 = {"Q4_0": 18, "Q4_1": 20}  # block bytes; 32 values a block


def _int4(gguf: GGUFFile, src: str) -> Int4Weight:
    """A Q4_0/Q4_1 matrix's blocks as an Int4Weight (the same values, no rounding)."""
    qtype = gguf.tensors[src].qtype.name
    raw = gguf.blocks(src)  # [N, K / 32 * block bytes]
    blocks = raw.reshape(raw.shape[0], -1, _Q4[qtype])  # [N, K / 32, bytes]
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0])
    if qtype == "Q4_1":
        mins = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0])
        mins = mins.float()
    else:
        mins = -8 * d.float()
    nibbles = torch.from_numpy(np.ascontiguousarray(blocks[..., -16:]))  # [N, K / 32, 16]
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).view(raw.shape[0], -1)  # [N, K]
    return Int4Weight(pack_nibbles(q), d.float(), mins, group_size=32)


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation. w: [n_heads * head_dim, ...] (a weight, or
    a bias of shape [n_heads * head_dim])."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())
