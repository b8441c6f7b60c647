"""Rotary position embedding (rotate-half layout, as HF Llama), with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, computed as HF transformers does."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
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


class RotaryEmbedding:
    """Precomputed cos/sin tables [max_positions, head_dim // 2], applied to flat [T, heads, D]."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv[None, :]
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; positions: [T] int64. Returns x rotated, in x's dtype."""
        cos = self.cos[positions][:, None, :].to(x.dtype)  # [T, 1, D/2]
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
