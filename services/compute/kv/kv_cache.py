"""The KV cache tensors: per layer K and V of shape [capacity, n_kv_heads, head_dim]."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, capacity, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy slots [src, src+n) to [dst, dst+n) in every layer; the ranges may overlap."""
        if n == 0 or src == dst:
            return
        for cache in (self.k, self.v):
            cache[:, dst : dst + n] = cache[:, src : src + n].clone()
