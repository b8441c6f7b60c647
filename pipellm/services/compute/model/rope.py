"""Rotary position embedding (rotate-half layout, as HF Llama), with linear, llama3 and longrope
scaling, on all of a head or (partial rotary, Phi-4-mini) on its first `rotary_dim` dims.

LongRoPE's short or long factors are chosen once per model, by `max_positions`. Partial rotary:
`head_order` permutes each q/k head's dims so that HF's pairs are the fused kernel's, and the
pass-through dims (cos 1, sin 0) come out exactly as they went in.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None,
                    max_positions: int = 0) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, computed as HF transformers does (`head_dim`:
    the rotary dims; `max_positions`: the served positions, which pick longrope's factors)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_positions)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        return _llama3(inv, factor, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def _llama3(inv: torch.Tensor, factor: float, s: dict) -> torch.Tensor:
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def uses_long_factors(scaling: dict, max_positions: int) -> bool:
    """Whether a model serving `max_positions` positions runs longrope's long factors."""
    return max_positions > scaling["original_max_position_embeddings"]


def _longrope(dim: int, theta: float, s: dict, max_positions: int) -> torch.Tensor:
    """transformers' `_compute_longrope_parameters` with the factors `uses_long_factors` picks."""
    key = "long_factor" if uses_long_factors(s, max_positions) else "short_factor"
    ext = torch.tensor(s[key], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def head_order(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """The order of a head's dims that puts HF's partial-rotary pairs (i, i + rotary_dim / 2)
    at the kernel's (i, i + head_dim / 2): [rotary first half, pass first half, rotary second
    half, pass second half]. None when RoPE turns the whole head."""
    if rotary_dim == head_dim:
        return None
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    idx = torch.arange(head_dim)
    return torch.cat([idx[:r], idx[2 * r:2 * r + p], idx[r:2 * r], idx[2 * r + p:]])


class RotaryEmbedding:
    """Precomputed cos/sin tables [max_positions, head_dim // 2], applied to flat [T, heads, D]
    (with partial rotary, to heads in `head_order`)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device, rotary_dim: int | None = None):
        rotary_dim = rotary_dim or head_dim
        inv = inv_frequencies(rotary_dim, theta, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        attention = (scaling or {}).get("attention_factor")
        if attention is not None:  # longrope: scales cos/sin as transformers does
            cos, sin = cos * attention, sin * attention
        pad = (head_dim - rotary_dim) // 2  # pass-through pairs: turned by angle 0
        if pad:
            cos = torch.cat([cos, torch.ones(max_positions, pad)], dim=1)
            sin = torch.cat([sin, torch.zeros(max_positions, pad)], dim=1)
        self.cos = cos.to(device)
        self.sin = sin.to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; positions: [T] int64. Returns x rotated, in x's dtype."""
        cos = self.cos[positions][:, None, :].to(x.dtype)  # [T, 1, D/2]
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
