"""INT8 KV cache: symmetric quantization in groups of KV_GROUP values along head_dim, one fp16
scale per group (the PPL.LLM talk's layout: groups of 8, fp16 scales): one byte per value plus
two per eight, 1.25 bytes against 2 for a 16-bit cache.

Layout, per layer: values int8 [capacity, n_kv_heads, head_dim], scales fp16
[capacity, n_kv_heads, head_dim // KV_GROUP]; value = int8 * scale. The RoPE + KV-write kernel
quantizes the rows it writes; the attention kernels dequantize the rows they read (one
sequence's at a time: never a dequantized copy of the cache).

FP8 KV cache (`--kv-cache-dtype fp8`): e4m3 values, one byte each, with a per-tensor scale of
1 (vLLM's default without calibrated scales): written saturated at +-448 (a plain cast would
turn larger values into NaN), read by converting to the query's dtype.

fp16 KV cache under float32 queries (`--kv-cache-dtype float16`, the CPU's float32 models):
half the bytes of a float32 cache, written rounded to nearest, read by converting to float32
(llama.cpp's default cache type).

These are the PyTorch reference functions (they run on any device).
"""

from __future__ import annotations

import torch

KV_GROUP = 8
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def float_caches(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The unquantized cache elements queries of `dtype` read: their own, and fp16 under
    float32 queries."""
    return (dtype, torch.float16) if dtype == torch.float32 else (dtype,)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as e4m3, saturated at +-FP8_MAX."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, Hkv, D] (D a multiple of KV_GROUP) -> (int8 [N, Hkv, D], fp16 scales
    [N, Hkv, D // KV_GROUP]). Each group's scale is its max |value| / 127, rounded to fp16
    first, so that dequantizing with the stored scale is what was quantized against; values
    round half away from zero (what the Triton write does too)."""
    n, h, d = x.shape
    groups = x.float().view(n, h, d // KV_GROUP, KV_GROUP)
    scale = (groups.abs().amax(-1) / 127.0).half()  # [N, Hkv, D / G]
    s = scale.float()[..., None]
    q = torch.where(s > 0, groups / torch.where(s > 0, s, 1.0), 0.0)
    q = q.sign() * (q.abs() + 0.5).floor()  # round half away from zero
    return q.clamp_(-127, 127).to(torch.int8).view(n, h, d), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(int8 [N, Hkv, D], fp16 [N, Hkv, D // KV_GROUP]) -> float32 [N, Hkv, D]."""
    n, h, d = q.shape
    return (q.view(n, h, d // KV_GROUP, KV_GROUP).float() * scale.float()[..., None]).view(n, h, d)


def kv_rows(cache: torch.Tensor, scale: torch.Tensor | None, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of one layer's K or V cache, as float32 [n, Hkv, D] (dequantized
    when `scale` is given; FP8 rows convert as they are)."""
    rows = cache[start : start + n]
    return rows.float() if scale is None else dequantize_kv(rows, scale[start : start + n])
