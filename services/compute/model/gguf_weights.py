"""Checkpoint tensors from a GGUF file, dequantized and renamed to Hugging Face names.

Invariant: the tensors come out as weights.py loads the HF checkpoint (Gemma norms as 1 + w):
llama.cpp's Q/K row permutation (`llama` files) undone, stacked experts split into per-expert
names. With `keep_int4`, Q4_0/Q4_1 decoder matrices stay in their 4-bit blocks (`Int4Weight`).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.int4_weight import Int4Weight, pack_nibbles
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

_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich norms; llama.cpp's `ffn_norm` is Gemma's pre_feedforward_layernorm
_SANDWICH = {"post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER = {"qwen3": _QK_NORMS, "gemma2": _SANDWICH, "gemma3": {**_SANDWICH, **_QK_NORMS},
               "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
               "qwen3moe": {**_QK_NORMS, "ffn_gate_inp": "mlp.gate"},
               "olmoe": {**_QK_NORMS, "ffn_gate_inp": "mlp.gate"},  # q/k norms: [H * D]
               "llama": {"ffn_gate_inp": "block_sparse_moe.gate"}}  # Mixtral
# stacked experts: GGUF name -> (HF module, {stack: expert's weight}) per architecture
_MLP_EXPERTS = ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                        "ffn_down_exps": "down_proj"})
_EXPERTS = {"qwen3moe": _MLP_EXPERTS, "olmoe": _MLP_EXPERTS,
            "llama": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3",
                                           "ffn_down_exps": "w2"})}
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


def kept_int4(gguf_name: str) -> bool:
    """Whether a Q4_0/Q4_1 tensor is kept as blocks under --quantization int4: the decoder's
    matrices, but for the MoE router (`ffn_gate_inp`, float as in vLLM; llama.cpp's converter
    stores it F32)."""
    return gguf_name.startswith("blk.") and ".ffn_gate_inp." not in gguf_name


def expert_names(gguf_name: str, arch: str, n_experts: int) -> list[str] | None:
    """`blk.3.ffn_up_exps.weight` -> the HF names of its n_experts slices, in order
    (`model.layers.3.mlp.experts.{e}.up_proj.weight`); None if not an expert stack."""
    parts = gguf_name.split(".")
    module, stacks = _EXPERTS.get(arch, ("", {}))
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in stacks:
        return None
    p = f"model.layers.{parts[1]}.{module}.experts"
    return [f"{p}.{e}.{stacks[parts[2]]}.{parts[3]}" for e in range(n_experts)]


def load_gguf_weights(path, dtype: torch.dtype, device,
                      keep_int4: bool = False) -> dict[str, torch.Tensor | Int4Weight]:
    """Every tensor of the GGUF file at `path`, as float `dtype` on `device`, HF-named; with
    `keep_int4`, decoder matrices stored as Q4_0/Q4_1 as Int4Weight instead.

    Raises ModelLoadError naming the file and the tensor for unknown tensors or types."""
    try:
        gguf, names, heads = _check(path)
        out = {}
        for src, name in progress(names.items(), len(names), "weights (tensors)"):
            if isinstance(name, list):  # stacked experts [E, rows, cols]: one tensor each
                out |= _experts(gguf, src, name, keep_int4, device, dtype)
            elif keep_int4 and kept_int4(src) and gguf.tensors[src].qtype.name in _Q4:
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


def _names(gguf: GGUFFile, arch: str) -> dict[str, str | list[str]]:
    """GGUF -> HF name, or the HF names of its experts for a stacked expert tensor."""
    names = {}
    for src, info in gguf.tensors.items():
        if src in NOT_WEIGHTS.get(arch, ()):
            continue
        name = hf_name(src, arch) or expert_names(src, arch, info.shape[0])
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


def _experts(gguf: GGUFFile, src: str, names: list[str], keep_int4: bool, device,
             dtype) -> dict:
    """A stacked expert tensor [E, rows, cols] split into `names` (E of them): float
    [rows, cols] slices, or with keep_int4 a Q4_0/Q4_1 stack's blocks as E Int4Weights."""
    qtype = gguf.tensors[src].qtype.name
    if keep_int4 and qtype in _Q4:
        raw = gguf.blocks(src)  # [E, rows, cols / 32 * block bytes]
        return {n: _int4_blocks(raw[e], qtype).to(device, dtype) for e, n in enumerate(names)}
    stack = torch.from_numpy(gguf.tensor(src)).to(device, dtype)  # [E, rows, cols]
    return dict(zip(names, stack.unbind(0), strict=True))


def _int4(gguf: GGUFFile, src: str) -> Int4Weight:
    """A Q4_0/Q4_1 matrix's blocks as an Int4Weight (the same values, no rounding)."""
    return _int4_blocks(gguf.blocks(src), gguf.tensors[src].qtype.name)


def _int4_blocks(raw: np.ndarray, qtype: str) -> Int4Weight:
    """Q4_0/Q4_1 rows `raw` [N, K / 32 * block bytes] (uint8) as an Int4Weight."""
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
