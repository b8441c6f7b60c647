"""W8A8 in blocks: 8-bit weights with one scale per block of 32 along K (a GGUF's Q8_0, or our
quantization of a float weight the same way), activations quantized to INT8 per row and block
of 32 on the fly. The layout, the quantization, the PyTorch reference and the CPU path.

Layout (`Q8Weight`): values int8 [N, K], scales fp16 [N, K // 32]; w[n, k] = values * scale,
scale = max |w| of the block / 127 (llama.cpp's Q8_0 rule: re-quantizing a Q8_0 tensor's float
copy gives its blocks back). On an x86 CPU with AVX2 or better the GEMM is
`pipellm/kernels/cpu/block_gemm.cpp` (weights repacked once at load by `pack_q8_blocks`); elsewhere
the reference (a float matmul).
Used for the LM head of a quantized GGUF model, as llama.cpp serves it (`model/linear/q8.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipellm.kernels.cpu import extension
from pipellm.kernels.dispatch import block_gemm_extension

BLOCK = 32


@dataclass
class Q8Weight:
    values: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp16 [N, K // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)


@dataclass
class Q8Blocks:
    """A Q8Weight repacked for the C++ block GEMM (layout: pipellm/kernels/cpu/block_gemm.cpp)."""

    qs: torch.Tensor  # int8 [N / 16, K / 32, 8, 16, 4], N padded to a multiple of 16
    scales: torch.Tensor  # fp16 [N / 16, K / 32, 16]
    corr: torch.Tensor  # float32 [N / 16, K / 32, 16]: 128 * the block's sum of values
    out_features: int


def quantize_q8(w: torch.Tensor) -> Q8Weight:
    """Float [N, K] (K % 32 == 0) -> blocks of 32 with scale max|w| / 127."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8 blocks of {BLOCK} do not fit K = {k}")
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    scale = (blocks.abs().amax(-1) / 127).half()  # the stored scale, as Q8_0 keeps it
    s = scale.float()[..., None]
    q = torch.where(s > 0, (blocks / torch.where(s > 0, s, 1)).round(), 0)
    return Q8Weight(q.clamp_(-127, 127).to(torch.int8).view(n, k), scale)


def dequantize_q8(w: Q8Weight) -> torch.Tensor:
    """The float32 [N, K] matrix a Q8Weight stands for."""
    return w.values.float() * w.scales.float().repeat_interleave(BLOCK, 1)


def pack_q8_blocks(w: Q8Weight) -> Q8Blocks:
    n, k = w.shape
    pad, nb = -n % 16, k // BLOCK
    tiles = (n + pad) // 16
    q = F.pad(w.values, (0, 0, 0, pad)).view(tiles, 16, nb, 8, 4)  # k = 4v + j
    qs = q.permute(0, 2, 3, 1, 4).contiguous()  # [tiles, nb, 8 v, 16 rows, 4 j]

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, nb] -> [tiles, nb, 16]
        return F.pad(t, (0, 0, 0, pad)).view(tiles, 16, nb).transpose(1, 2).contiguous()

    sums = w.values.view(n, nb, BLOCK).sum(-1, dtype=torch.int32).float() * 128
    return Q8Blocks(qs, per_block(w.scales), per_block(sums), n)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> float32 [T, K]: each row's blocks of 32 rounded to symmetric INT8 (scale
    max|x| / 127) and back, as the C++ block GEMMs quantize their activations."""
    xb = x.float().reshape(-1, x.shape[-1] // BLOCK, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.where(d > 0, (xb / d).round(), 0) * d).view(-1, x.shape[-1])


def q8_gemm_ref(x: torch.Tensor, w: Q8Weight, bias=None) -> torch.Tensor:
    """PyTorch reference: x rounded as the kernel quantizes it times the dequantized weight,
    in float32, in x's dtype."""
    out = round_activations(x) @ dequantize_q8(w).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def prepare_q8(w: Q8Weight) -> Q8Weight | Q8Blocks:
    """Repacked for the C++ block GEMM where it runs (made once at load), else as is."""
    return pack_q8_blocks(w) if block_gemm_extension(w.values) else w


def q8_gemm(x: torch.Tensor, w: Q8Weight | Q8Blocks, bias=None) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) -> [..., N] in x's dtype; w from `prepare_q8`."""
    if not isinstance(w, Q8Blocks):
        return q8_gemm_ref(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = extension().q8_gemm(x2 if x2.stride(-1) == 1 else x2.contiguous(), w.qs, w.scales,
                              w.corr, w.out_features, bias)
    return out.view(*x.shape[:-1], w.out_features)
