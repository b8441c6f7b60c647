"""Checkpoint tensors from a GGUF file, dequantized and renamed to Hugging Face names.

Invariant: the tensors come out as weights.py loads the HF checkpoint (Gemma norms as 1 + w):
llama.cpp's Q/K row permutation (`llama` files) undone, stacked experts split into per-expert
names. With `keep_int4`, Q4_0/Q4_1 decoder matrices stay in their 4-bit blocks (`Int4Weight`).
"""

from __future__ import annotations

import numpy as np
import torch

from pipellm.kernels.int4_weight import Int4Weight, pack_nibbles
from pipellm.services.compute.model.progress import progress
from pipellm.shared.gguf.names import check_tensors, kept_int4
from pipellm.shared.gguf.reader import GGUFError, GGUFFile
from pipellm.shared.model_config import ModelLoadError


def load_gguf_weights(path, dtype: torch.dtype, device,
                      keep_int4: bool = False) -> dict[str, torch.Tensor | Int4Weight]:
    """Every tensor of the GGUF file at `path`, as float `dtype` on `device`, HF-named; with
    `keep_int4`, decoder matrices stored as Q4_0/Q4_1 as Int4Weight instead.

    Raises ModelLoadError naming the file and the tensor for unknown tensors or types."""
    try:
        gguf, names, heads = check_tensors(path)
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
