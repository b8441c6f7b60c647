"""The INT4 weight layout every W4A16 path starts from, and our float -> INT4 quantization.

Layout (`Int4Weight`, GGUF Q4_1's block semantics, so Q4_0/Q4_1 blocks map onto it exactly):
    packed  uint8 [N, K // 2]  byte j of row n: k = 2j in the low nibble, k = 2j + 1 in the high
    scales  [N, K // G]        one per group of G consecutive k (G = group_size: 32, 64 or 128)
    mins    [N, K // G]
    w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G],   q in [0, 15]

Each kernel path repacks it once at load where it wants another layout
(pipellm/kernels/int4_gemm.py's `prepare_int4`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZES = (32, 64, 128)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # [N, K // G]
    mins: torch.Tensor  # [N, K // G]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins))

    def to(self, device, dtype: torch.dtype) -> Int4Weight:
        """On `device`, scales and mins in `dtype`."""
        return Int4Weight(self.packed.to(device), self.scales.to(device, dtype),
                          self.mins.to(device, dtype), self.group_size)

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Concatenate along N (fused projections); every part has the same K and group."""
        if len({(p.shape[1], p.group_size) for p in parts}) != 1:
            raise ValueError("fused INT4 weights need the same K and group size")
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts])
                            for f in ("packed", "scales", "mins")), parts[0].group_size)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in [0, 15] (K even) -> uint8 [N, K // 2] (even k in the low nibble)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 [N, K] in [0, 15]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Our float -> INT4: per group, min and max map to 0 and 15 (llama.cpp's Q4_1 rule):
    scale = (max - min) / 15, q = round((w - min) / scale). w [N, K], K % group_size == 0."""
    n, k = w.shape
    if group_size not in GROUP_SIZES or k % group_size:
        raise ValueError(f"INT4 groups of {group_size} do not fit K = {k} "
                         f"(group sizes: {GROUP_SIZES})")
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)  # [N, K / G]
    scale = (hi - lo) / 15
    q = ((groups - lo[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None]).round()
    return Int4Weight(pack_nibbles(q.clamp_(0, 15).view(n, k)), scale, lo, group_size)


def dequantize_int4(w: Int4Weight) -> torch.Tensor:
    """The float32 [N, K] matrix an Int4Weight stands for (the reference's weight)."""
    g = w.group_size
    q = unpack_nibbles(w.packed).float()
    return (q * w.scales.float().repeat_interleave(g, 1)
            + w.mins.float().repeat_interleave(g, 1))


def scales_zeros(w: Int4Weight) -> torch.Tensor:
    """bf16 [K / G, N, 2]: (scale, zero = min + 8 scale) per group, the dequantization
    (q - 8) scale + zero of PyTorch's int4 kernels (its CPU one, pipellm/kernels/int4_cpu.py, and
    tinygemm, pipellm/kernels/int4_tiles.py) for an Int4Weight's q scale + min."""
    s, mn = w.scales.float(), w.mins.float()
    return torch.stack([s.t(), (mn + 8 * s).t()], dim=-1).to(torch.bfloat16).contiguous()
