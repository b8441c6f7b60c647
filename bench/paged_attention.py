"""Decode attention over a paged KV cache (vLLM's layout): the baseline pipellm's contiguous
segments are measured against (bench/kernels.py), not a serving path, hence here and not in
`kernels`.

Sequence b's token t sits in slot block_table[b, t // page_size] * page_size + t % page_size
of the [capacity, n_kv_heads, head_dim] cache. `_paged_split_kernel` is a copy of the
production flash-decoding split kernel (`pipellm.kernels.decode_attention._decode_split_kernel`)
whose only change is that row lookup, one block-table read per token's page; the rest is the
production module's own: the `_qk`/`_pv`/`_split_len` helpers, the tiling (`TILINGS['16bit']`), the
split count (`_num_splits`) and the combine kernel. So the comparison measures the block table
alone. 16-bit (or fp32) K/V only: the baseline has no INT8/FP8 branches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pipellm.kernels.decode_attention import (
    TILINGS,
    _check_inputs,
    _decode_combine_kernel,
    _num_splits,
    _pv,
    _qk,
    _split_len,
    decode_attention_reference,
)


@triton.jit
def _paged_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr,  # q [B, H, D]; k, v [capacity, Hkv, D]; table; [B]
    out_ptr, part_o_ptr, part_lse_ptr,  # out [B, H, D]; part_o [B, H, S, D]; part_lse [B, H, S]
    stride_tb,  # block table [B, max pages] int32, page p = slots p*PAGE .. p*PAGE + PAGE - 1
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, DIRECT: tl.constexpr, PAGE: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    n = tl.load(lens_ptr + b)
    split_len = _split_len(n, num_splits, BLOCK_N)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n)  # tokens [lo, hi) of b; empty (lo >= hi) for short b

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] query head within the group (padded)
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    h_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h  # [BLOCK_H] query heads
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None], other=0.0)  # [BLOCK_H, D]
    k_base = k_ptr + kvh * stride_kh + offs_d[None, :]  # [1, D]
    v_base = v_ptr + kvh * stride_vh + offs_d[None, :]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)  # unnormalized output
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + offs_n  # [BLOCK_N] token positions
        t_mask = t < hi
        # token t sits in its page's slots: table[b, t // PAGE] * PAGE + t % PAGE
        page = tl.load(table_ptr + b * stride_tb + t // PAGE, mask=t_mask, other=0)
        rows = page.to(tl.int64) * PAGE + t % PAGE  # [BLOCK_N] int64 cache slots
        k = tl.load(k_base + rows[:, None] * stride_kt, mask=t_mask[:, None], other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vt, mask=t_mask[:, None], other=0.0)
        s = _qk(q, k, USE_DOT, UPCAST_DOT) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every chunk has a valid token
        alpha = tl.exp2(m - m_new)  # [BLOCK_H]
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _pv(p, v, USE_DOT, UPCAST_DOT)
        m = m_new

    l_i = tl.maximum(l_i, 1.0)  # no-op (l >= 1: the max term is exp2(0)) except in empty splits
    if DIRECT:  # one split: final output
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=h_mask[:, None])
    else:  # empty splits store nothing; the combine kernel skips them
        valid = offs_h < tl.where(lo < hi, GROUP, 0)  # [BLOCK_H]
        row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None],
                 mask=valid[:, None])
        tl.store(part_lse_ptr + row, m + tl.log2(l_i), mask=valid)


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
                           page_size: int, max_seq_len: int,
                           num_splits: int | None = None) -> torch.Tensor:
    """q [B, H, D]; caches [capacity, Hkv, D] in q's dtype; block_table [B, max pages] int32;
    seq_lens [B] int32 >= 1 -> [B, H, D]. The Triton kernel (a CUDA device, or the
    interpreter), launched exactly as `pipellm.kernels.decode_attention._decode_attention_triton`
    launches the contiguous one (num_splits None: the same `_num_splits` heuristic)."""
    _check_inputs(q, k_cache, v_cache, seq_lens, seq_lens)
    batch, n_heads, head_dim = q.shape
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.stride(-1) != 1:
        raise ValueError("decode_attention_paged: block_table must be [B, max pages] with a "
                         "contiguous last dim")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError("decode_attention_paged: K/V must be in q's dtype (no quantized KV)")
    n_kv_heads = k_cache.shape[1]
    group = n_heads // n_kv_heads
    tiling = TILINGS["16bit"]
    if num_splits is None:
        num_splits = _num_splits(batch, n_kv_heads, max_seq_len, q.device,
                                 tiling.min_split_tokens)
    out = torch.empty((batch, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    use_dot = group > 1  # tl.dot needs >= 16 rows: pad the group; MHA uses broadcast sums
    block_h = max(16, triton.next_power_of_2(group)) if use_dot else 1
    part_o = part_lse = out  # unused placeholders when num_splits == 1
    if num_splits > 1:
        part_o = torch.empty((batch, n_heads, num_splits, head_dim), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty((batch, n_heads, num_splits), dtype=torch.float32, device=q.device)
    _paged_split_kernel[(batch, n_kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_o, part_lse, block_table.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        scale * math.log2(math.e),
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_N=tiling.block_n, USE_DOT=use_dot,
        UPCAST_DOT=not q.is_cuda and q.dtype == torch.bfloat16, DIRECT=num_splits == 1,
        PAGE=page_size, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    if num_splits > 1:
        _decode_combine_kernel[(batch, n_heads)](
            part_o, part_lse, seq_lens, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_N=tiling.block_n,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4,
        )
    return out
