"""Decode attention over a paged KV cache (vLLM's layout): the baseline pipellm's contiguous
segments are measured against (bench/kernels.py), not a serving path, hence here and not in
`kernels`.

Sequence b's token t sits in slot block_table[b, t // page_size] * page_size + t % page_size
of the [capacity, n_kv_heads, head_dim] cache: the same flash-decoding kernel as
`decode_attention`, with one block-table read per token's page (`PAGED`).
"""

from __future__ import annotations

import torch

from kernels.decode_attention import _decode_attention_triton, decode_attention_reference


def paged_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                ) -> list[torch.Tensor]:
    """Per sequence, the cache slots of its tokens in order ([n] int64 each)."""
    out = []
    for pages, n in zip(block_table.tolist(), seq_lens.tolist(), strict=True):
        t = torch.arange(n)
        out.append(torch.tensor(pages, dtype=torch.int64)[t // page_size] * page_size
                   + t % page_size)
    return out


def decode_attention_paged_reference(q, k_cache, v_cache, block_table, seq_lens, scale,
                                     page_size: int) -> torch.Tensor:
    """Gather each sequence's pages into a contiguous copy, then the contiguous reference."""
    slots = [s.to(q.device) for s in paged_slots(block_table, seq_lens, page_size)]
    flat = torch.cat(slots)
    starts = torch.tensor([0] + [len(s) for s in slots[:-1]]).cumsum(0).to(q.device)
    return decode_attention_reference(q, k_cache[flat], v_cache[flat], starts, seq_lens, scale)


def decode_attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           page_size: int, max_seq_len: int) -> torch.Tensor:
    """q [B, H, D]; caches [capacity, Hkv, D]; block_table [B, max pages] int32; seq_lens [B]
    int32 >= 1 -> [B, H, D]. The Triton kernel (a CUDA device, or the interpreter)."""
    return _decode_attention_triton(q, k_cache, v_cache, seq_lens, seq_lens, scale, max_seq_len,
                                    block_table=block_table, page_size=page_size)
