"""Attention over the contiguous KV cache: PyTorch references (the CPU path).

Cache layout, per layer: K and V of shape [capacity, n_kv_heads, head_dim]. Sequence b owns the
contiguous slots [kv_starts[b], kv_starts[b] + kv_lens[b]); its newest tokens' K/V are
already written there when these functions run. GQA: query head h reads KV head
h // (n_heads // n_kv_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(
    q: torch.Tensor,  # [Tp, H, D] queries of all prefill chunks, concatenated
    k_cache: torch.Tensor,  # [capacity, Hkv, D]
    v_cache: torch.Tensor,  # [capacity, Hkv, D]
    cu_q_lens: list[int],  # [B+1] chunk b's queries are q[cu_q_lens[b]:cu_q_lens[b+1]]
    kv_starts: list[int],  # [B] first slot of sequence b
    kv_lens: list[int],  # [B] tokens of b in cache, including this chunk
    scale: float,
) -> torch.Tensor:  # [Tp, H, D]
    """Causal attention of each chunk over its sequence's cached prefix plus itself.

    Query i of chunk b sits at position kv_lens[b] - q_len + i and sees keys 0..that position.
    """
    out = torch.empty_like(q)
    for b in range(len(kv_starts)):
        q0, q1 = cu_q_lens[b], cu_q_lens[b + 1]
        s, n = kv_starts[b], kv_lens[b]
        qb = q[q0:q1].transpose(0, 1)  # [H, q_len, D]
        kb = k_cache[s : s + n].transpose(0, 1)  # [Hkv, n, D]
        vb = v_cache[s : s + n].transpose(0, 1)
        q_len = q1 - q0
        q_pos = torch.arange(n - q_len, n, device=q.device)[:, None]
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos  # [q_len, n]
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[q0:q1] = ob.transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor,  # [B, H, D] one query per sequence
    k_cache: torch.Tensor,  # [capacity, Hkv, D]
    v_cache: torch.Tensor,  # [capacity, Hkv, D]
    kv_starts: list[int],  # [B] first slot of sequence b
    kv_lens: list[int],  # [B] tokens of b in cache, including this one (>= 1)
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Single-query attention of each sequence over all its cached tokens.

    The reference loops over sequences: a padded gather would copy max_len x B KV rows per layer,
    which on a CPU costs more than the loop. The Triton kernel does split-KV instead.
    """
    out = torch.empty_like(q)
    for b in range(len(kv_starts)):
        s, n = kv_starts[b], kv_lens[b]
        kb = k_cache[s : s + n].transpose(0, 1)  # [Hkv, n, D]
        vb = v_cache[s : s + n].transpose(0, 1)
        ob = F.scaled_dot_product_attention(q[b, :, None, :], kb, vb, scale=scale, enable_gqa=True)
        out[b] = ob[:, 0, :]
    return out
