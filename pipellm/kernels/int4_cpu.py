"""INT4 weights on a CPU: the layouts of the two CPU kernels, made once at load from an
Int4Weight, and the call of each.

On an x86 CPU with AVX2 or better the path is W4A8 (`pipellm/kernels/cpu/block_gemm.cpp`,
llama.cpp's Q4_1 x Q8_1 scheme, a variant per ISA level chosen at run time): the activations are
quantized to INT8 per row and block of 32 on the fly, each block's dot product runs in INT32, and
the scales apply once per block; the weight is repacked once at load (`pack_int4_blocks`, scales and
mins in fp16: a GGUF's own). Its reference is `int4_q8_gemm_ref`. Elsewhere on a CPU (ARM, or
x86 below AVX2), PyTorch's int4 kernel (`_weight_int4pack_mm_for_cpu`, bfloat16 activations),
whose dequantization is (q - 8) * scale + zero: repacked at load (`pack_int4_cpu`) with
zero = min + 8 * scale, scales and zeros rounded to bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipellm.kernels.int4_weight import Int4Weight, dequantize_int4, scales_zeros, unpack_nibbles
from pipellm.kernels.q8_gemm import round_activations


@dataclass
class Int4Cpu:
    """An Int4Weight repacked for PyTorch's CPU int4 kernel."""

    packed: torch.Tensor  # uint8, the kernel's layout
    scales_zeros: torch.Tensor  # bfloat16 [K // G, N, 2]: (scale, min + 8 * scale)
    group_size: int
    out_features: int


def pack_int4_cpu(w: Int4Weight) -> Int4Cpu:
    q = unpack_nibbles(w.packed).to(torch.int32)  # [N, K]
    return Int4Cpu(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros(w),
                   w.group_size, w.shape[0])


def int4_gemm_cpu(x: torch.Tensor, w: Int4Cpu, bias=None) -> torch.Tensor:
    """CPU: x [..., K] (any float dtype; computed in bfloat16) -> [..., N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, w.group_size,
                                                     w.scales_zeros).to(x.dtype)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], w.out_features)


@dataclass
class Int4Blocks:
    """An Int4Weight repacked for the C++ block GEMM (layout:
    pipellm/kernels/cpu/block_gemm.cpp)."""

    qs: torch.Tensor  # uint8 [N / 16, K / 32, 4, 16, 4], N padded to a multiple of 16
    scales: torch.Tensor  # fp16 [N / 16, K / 32, 16], one per block of 32
    mins: torch.Tensor  # fp16 [N / 16, K / 32, 16]
    out_features: int


def pack_int4_blocks(w: Int4Weight) -> Int4Blocks:
    q = unpack_nibbles(w.packed)  # [N, K]
    n, k = q.shape
    pad, nb = -n % 16, k // 32
    q = F.pad(q, (0, 0, 0, pad))
    tiles = q.shape[0] // 16
    q = q.view(tiles, 16, nb, 32).transpose(1, 2)  # [tiles, nb, 16 rows, 32 k]
    lo, hi = (half.reshape(tiles, nb, 16, 4, 4) for half in (q[..., :16], q[..., 16:]))
    qs = (lo | (hi << 4)).transpose(2, 3).contiguous()  # byte: k = 4v + j low, 16 + 4v + j high

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, K / G] -> [tiles, nb, 16] fp16
        t = F.pad(t.float().repeat_interleave(w.group_size // 32, 1), (0, 0, 0, pad))
        return t.view(tiles, 16, nb).transpose(1, 2).contiguous().half()

    return Int4Blocks(qs, per_block(w.scales), per_block(w.mins), n)


def int4_q8_gemm_ref(x: torch.Tensor, w: Int4Weight, bias=None) -> torch.Tensor:
    """PyTorch reference of the C++ block GEMM: x rounded as it quantizes it (per row and block of
    32, symmetric INT8), times the weight with fp16 scales and mins, in float32."""
    half = Int4Weight(w.packed, w.scales.half().float(), w.mins.half().float(), w.group_size)
    out = round_activations(x) @ dequantize_int4(half).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])
