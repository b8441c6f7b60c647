"""The KV cache tensors: per layer K and V of shape [capacity, n_kv_heads, head_dim], in the
model's dtype, fp16 (under a float32 model), INT8 with fp16 scales per group of KV_GROUP values,
or FP8 e4m3 with scale 1 (pipellm/kernels/kv_quant.py). `kv_dtype` is --kv-cache-dtype as resolved
at start-up (element.kv_cache_dtype): auto (the model's), float32, float16, int8 or fp8."""

from __future__ import annotations

import torch

from pipellm.kernels.kv_quant import FP8, KV_GROUP

STORE = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8,
         "fp8": FP8}  # auto: the model's dtype


class KVCache:
    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv_dtype: str = "auto"):
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        int8 = kv_dtype == "int8"
        store = STORE.get(kv_dtype, dtype)
        self.k = torch.zeros(shape, dtype=store, device=device)  # [L, capacity, Hkv, D]
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None  # INT8: [L, capacity, Hkv, D / KV_GROUP] fp16
        if int8:
            scales = (num_layers, capacity, num_kv_heads, head_dim // KV_GROUP)
            self.k_scale = torch.zeros(scales, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(scales, dtype=torch.float16, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_dtype: str = "auto") -> int:
        """K and V of one token in every layer (INT8: the values and their scales)."""
        element = STORE.get(kv_dtype, dtype).itemsize
        per_head = head_dim * element + (2 * (head_dim // KV_GROUP) if kv_dtype == "int8" else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K scales, V scales) of one layer; (None, None) for a cache in the model's dtype."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy slots [src, src+n) to [dst, dst+n) in every layer; the ranges may overlap."""
        if n == 0 or src == dst:
            return
        for cache in (self.k, self.v, self.k_scale, self.v_scale):
            if cache is not None:
                cache[:, dst : dst + n] = cache[:, src : src + n].clone()
