"""Rotary position embedding (rotate-half layout, as HF Llama), with linear, llama3 and longrope
scaling, on all of a head or (partial rotary, Phi-4-mini) on its first `rotary_dim` dims.

LongRoPE (Phi-3). transformers picks the short or the long factors per forward call, by the
length of the sequence so far (`longrope_frequency_update`: long once max(position) + 1 >
original_max_position_embeddings); a sequence that crosses that length during generation
keeps the K it cached with the short factors beside new K rotated with the long ones. Here the
choice is made once per model, by the positions it serves, as vLLM and llama.cpp do: the long
factors when `max_positions` (the served context, --max-model-len) exceeds
original_max_position_embeddings, else the short ones. Both agree with transformers for every
sequence that ends within the original length when served with max_positions <= it, and for
every sequence whose prompt already exceeds it; in between (short prompt, long output, or a
short sequence on a long-context server) they differ. The attention factor scales cos and sin
in both cases, as in transformers.

Partial rotary. The fused RoPE kernel turns pairs (i, i + head_dim / 2) of a whole head; HF
turns pairs (i, i + rotary_dim / 2) of the first rotary_dim dims and passes the rest through.
`head_order` permutes each q/k head's dims (their projection rows) so that HF's pairs become
the kernel's, and the tables' extra columns are cos = 1, sin = 0 (the pass-through dims come
out exactly as they went in). Scores q . k do not depend on the order of the dims.
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
