"""INT4 weights in tinygemm's tensor-core tile layout: CUDA's few-row GEMM for bf16 activations.

PyTorch's CUDA int4 kernel (`torch.ops.aten._weight_int4pack_mm`, tinygemm, the one gpt-fast
and torchao serve with) reads the weight as m16n8k16 B-operand tiles, made once at load from an
`Int4Weight` (`pack_tiles`). It is fast at up to 8 rows and slow at more (docs/benchmarks.md),
so `pipellm/kernels/int4_gemm.py` keeps it beside the Int4Weight and calls it for steps of up to
`TINYGEMM_ROWS` rows only.

Layout (`Int4Tiles.tiles`, int32 [N / 8, K / (16 I), 32, I / 2], I = inner_k_tiles in 2, 4, 8):
the value at (n, k), with k = ((ko I / 2 + w) 2 + s) 16 + (h 4 + c) 2 + e, lies in word
tiles[n // 8, ko, (n % 8) 4 + c, w] at bit 4 (2 s + h) + 16 e (torch's
`_convert_weight_to_int4pack` of bytes holding even k in the high nibble; `pack_tiles_ref` is
that permutation in PyTorch, tested equal on a GPU).
Dequantization (tinygemm's): w = (q - 8) scale + zero, scales_zeros[k // G, n] = (scale, zero),
zero = min + 8 scale, both rounded to bf16 (the same values Int4Weight's q scale + min gives,
up to that rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipellm.kernels.int4_weight import Int4Weight, scales_zeros, unpack_nibbles

TILE_GROUPS = (32, 64, 128, 256)
# bit of each of a word's 8 values, in the order (s, h, e) of the layout's k
_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)


@dataclass
class Int4Tiles:
    """An INT4 weight [N, K] in tinygemm's layout (this module's docstring)."""

    tiles: torch.Tensor  # int32 [N / 8, K / (16 I), 32, I / 2]
    scales_zeros: torch.Tensor  # bf16 [K / G, N, 2]
    group_size: int

    @property
    def inner_k_tiles(self) -> int:
        return 2 * self.tiles.shape[-1]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight the tiles hold."""
        return 8 * self.tiles.shape[0], 16 * self.inner_k_tiles * self.tiles.shape[1]


def inner_k_tiles(k: int) -> int:
    """The widest inner K tiling that divides K (8: 16-byte loads), 0 where none does."""
    return next((i for i in (8, 4, 2) if k % (16 * i) == 0), 0)


def tiles_fit(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """Whether an [n, k] Int4Weight with these groups serves from tiles: bf16 activations, N a
    multiple of 8, K of 32, a group tinygemm takes."""
    return (dtype == torch.bfloat16 and n % 8 == 0 and inner_k_tiles(k) > 0
            and group_size in TILE_GROUPS and k % group_size == 0)


def pack_tiles_ref(w: Int4Weight) -> torch.Tensor:
    """The tile words of an Int4Weight, by the layout's permutation (any device)."""
    q = unpack_nibbles(w.packed).to(torch.int64)
    n, k = q.shape
    i = inner_k_tiles(k)
    q = q.view(n // 8, 8, k // (16 * i), i // 2, 2, 2, 4, 2)  # nt r ko w s h c e
    q = q.permute(0, 2, 1, 6, 3, 4, 5, 7).reshape(n // 8, k // (16 * i), 32, i // 2, 8)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=q.device)
    words = (q << shifts).sum(-1)  # < 2^32
    return (words - ((words >> 31) << 32)).to(torch.int32)  # as signed 32-bit


def pack_tiles(w: Int4Weight, inner: int | None = None) -> Int4Tiles:
    """An Int4Weight (on CUDA, bf16 scales) in tinygemm's layout, by torch's own packing, with
    `inner` K tiles (2, 4 or 8 dividing K / 16; None: the widest, `inner_k_tiles`)."""
    swapped = ((w.packed << 4) | (w.packed >> 4)).contiguous()  # even k in the high nibble
    tiles = torch.ops.aten._convert_weight_to_int4pack(swapped, inner or inner_k_tiles(w.shape[1]))
    return Int4Tiles(tiles, scales_zeros(w), w.group_size)


def dequantize_tiles_ref(t: Int4Tiles) -> torch.Tensor:
    """PyTorch reference of the tiles' matrix, float32: tinygemm's (q - 8) scale + zero."""
    n, k = t.shape
    i = t.inner_k_tiles
    words = t.tiles.to(torch.int64).unsqueeze(-1) >> torch.tensor(_SHIFTS, device=t.tiles.device)
    q = (words & 0xF).view(n // 8, k // (16 * i), 8, 4, i // 2, 2, 2, 2)  # nt ko r c w s h e
    q = q.permute(0, 2, 1, 4, 5, 6, 3, 7).reshape(n, k).float()
    sz = t.scales_zeros.float().repeat_interleave(t.group_size, 0)  # [K, N, 2]
    return (q - 8) * sz[..., 0].t() + sz[..., 1].t()


def int4_tiles_gemm(x: torch.Tensor, t: Int4Tiles, bias=None) -> torch.Tensor:
    """x [..., K] bf16 @ W^T (+ bias) -> [..., N] bf16, by tinygemm."""
    n, k = t.shape
    out = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, k).contiguous(), t.tiles,
                                             t.group_size, t.scales_zeros)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)
