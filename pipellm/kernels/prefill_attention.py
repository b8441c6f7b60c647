"""Prefill (and chunked-prefill) attention over the contiguous KV cache: Triton kernel + reference.

Cache layout, per layer: K and V of shape [capacity, n_kv_heads, head_dim]. Sequence s owns the
contiguous slots [seq_starts[s], seq_starts[s] + ctx_lens[s]); its new tokens' K/V are already
written there. Its q_len = cu_q_lens[s+1] - cu_q_lens[s] new queries are the last q_len tokens of
the sequence: query i sits at position ctx_lens[s] - q_len + i and sees keys 0..that position
(a chunk attends to its cached prefix plus itself, causally). GQA: query head h reads KV head
h // (n_heads // n_kv_heads). Sliding window (`window` > 0, one per layer): the query at
position p sees only keys at positions (p - window, p], transformers' `sliding_window_overlay`
(kv_idx > q_idx - window) on its causal mask.

The kernel is FlashAttention-2 style: one program per (BLOCK_M queries, sequence, head) tile
loops over the sequence's KV blocks up to its causal limit with an online softmax (fp32, exp2 on
log2(e)-prescaled scores). Blocks entirely below the diagonal run unmasked; only the blocks the
tile's diagonal crosses are masked; blocks above it are never loaded. With a window (WINDOW, a
constexpr) the loop starts at the block holding the tile's first visible key, and the blocks
the window's left edge crosses are masked too. SOFTCAP > 0 (Gemma 2): each score s = scale * q.k
becomes SOFTCAP * tanh(s / SOFTCAP) before the mask and softmax (in every path). Static configs
by head_dim (no autotuning: deterministic, and fast under the interpreter). fp32 inputs use
tl.dot's "tf32x3" (about fp32 accuracy on tensor cores; "ieee" compiles to a register-spilling
FMA loop on sm_90).

INT8 caches (KV_INT8): K/V int8 with an fp16 scale per KV_GROUP values, dequantized in
registers after the load.

On a CPU, `_prefill_attention_cpu`: per sequence and block of 128 queries (scoring only the
keys the block sees), every KV head in one batched GEMM against K, the group of query heads
that share one as rows of it (no K/V copy for GQA), an additive causal mask, softmax and one
batched GEMM with V: faster on the CPU than the masked SDPA of the reference (whose GQA/mask path
falls back to batched small matmuls; docs/benchmarks.md). Where the C++ kernels run (an x86
level) and there is no softcap, the C++ kernel instead (pipellm/kernels/cpu/prefill_attention.cpp):
bf16 without a window on AMX tiles at the amx level (float32 scores and sums, P in two bf16
parts), else float32 vectors of the level (AVX2, AVX-512; INT8 and FP8 caches dequantized as
it packs a sequence's keys and values).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipellm.kernels.decode_attention import _tanh
from pipellm.kernels.dispatch import cpu_extension, cpu_fast_path, use_triton
from pipellm.kernels.kv_quant import FP8, KV_GROUP, float_caches, kv_rows

_LOG2E = tl.constexpr(1.4426950408889634)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a constexpr: jit code may read it


@triton.jit
def _attn_blocks(
    acc, l_i, m_i, q, pos_m, k_base, v_base, ks_base, vs_base, lo, hi, stride_kt, stride_vt,
    stride_st, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, KV_INT8: tl.constexpr, KV_GROUP: tl.constexpr,
    KV_FP8: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online-softmax update over keys [lo, hi) of one sequence (MASKED: also mask causally,
    and with WINDOW > 0 keys at or before pos_m - WINDOW).

    acc [BM, D] fp32, l_i/m_i [BM] fp32 (running max in log2 units), q [BM, D],
    pos_m [BM] query positions, k_base/v_base scalar pointers to key 0 of the segment and head,
    qk_scale = scale * log2(e) (so exp2 of scaled scores is exp of the true logits).
    KV_INT8: K/V are int8, ks_base/vs_base point at key 0's fp16 scales (one per KV_GROUP
    values, stride_st apart): dequantized in registers to q's dtype.
    """
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BN] key positions
        k_ptrs = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]  # [BN, D]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]  # [BN, D]
        s_off = offs_n[:, None] * stride_st + (offs_d // KV_GROUP)[None, :]  # [BN, D]
        if MASKED:
            k = tl.load(k_ptrs, mask=(offs_n < hi)[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n < hi)[:, None], other=0.0)
            if KV_INT8:
                k_sc = tl.load(ks_base + s_off, mask=(offs_n < hi)[:, None], other=0.0)
                v_sc = tl.load(vs_base + s_off, mask=(offs_n < hi)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
            if KV_INT8:
                k_sc = tl.load(ks_base + s_off)
                v_sc = tl.load(vs_base + s_off)
        if KV_INT8:
            k = (k.to(tl.float32) * k_sc.to(tl.float32)).to(q.dtype)
            v = (v.to(tl.float32) * v_sc.to(tl.float32)).to(q.dtype)
        if KV_FP8:  # e4m3 values, scale 1
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BM, BN] fp32
        if SOFTCAP > 0:  # the cap of the true score s is SOFTCAP * log2(e) on s * log2(e)
            qk = (SOFTCAP * _LOG2E) * _tanh(qk / (SOFTCAP * _LOG2E))
        if MASKED:
            visible = offs_n[None, :] <= pos_m[:, None]  # [BM, BN]
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > pos_m[:, None] - WINDOW)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BM]
        if WINDOW > 0:  # a row may see no key of a block yet (-inf max): keep exp2 finite
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_new[:, None])  # [BM, BN]
        alpha = tl.math.exp2(m_i - m_new)  # [BM]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _window_blocks(first_pos, hi, full_end, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """(lo, mid) for a query tile at positions [first_pos, hi): its keys fall in blocks
    [lo, mid) that the window's left edge crosses (masked), [mid, full_end) visible to every
    row (unmasked) and [full_end, hi) that the diagonal crosses (masked). Without a window
    lo = mid = 0. Invariant: lo <= mid <= full_end <= hi, all but hi multiples of BLOCK_N."""
    lo = full_end * 0
    mid = lo
    if WINDOW > 0:  # the first row's first visible key; every row sees the keys >= hi - WINDOW
        lo = (tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N  # (no negative //)
        all_see = tl.cdiv(tl.maximum(hi - WINDOW, 0), BLOCK_N) * BLOCK_N
        mid = tl.minimum(tl.maximum(all_see, lo), full_end)
    return lo, mid


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, starts_ptr, ctx_ptr, ks_ptr, vs_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_st, stride_sh,  # KV_INT8: the scales' [capacity, Hkv, D / KV_GROUP] strides
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, KV_INT8: tl.constexpr, KV_GROUP: tl.constexpr,
    KV_FP8: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Grid (cdiv(max_q_len, BLOCK_M), S, n_heads): one BLOCK_M query tile of one seq and head."""
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    n_tiles = tl.cdiv(q_len, BLOCK_M)
    if tl.program_id(0) >= n_tiles:
        return
    start_m = (n_tiles - 1 - tl.program_id(0)) * BLOCK_M  # heaviest (last) tile first
    ctx = tl.load(ctx_ptr + seq)
    prefix = ctx - q_len  # position of the sequence's first new query
    kv_start = tl.load(starts_ptr + seq).to(tl.int64)

    offs_m = start_m + tl.arange(0, BLOCK_M)  # [BM] query index within the sequence
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    rows_q = (q_start + offs_m).to(tl.int64)  # [BM] token index into q / out
    q_ptrs = q_ptr + rows_q[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m < q_len)[:, None], other=0.0)  # [BM, D]

    kv_head = head // GROUP
    k_base = k_ptr + kv_start * stride_kt + kv_head * stride_kh  # scalar: key 0 of the segment
    v_base = v_ptr + kv_start * stride_vt + kv_head * stride_vh
    ks_base = ks_ptr + kv_start * stride_st + kv_head * stride_sh  # (placeholders unless INT8)
    vs_base = vs_ptr + kv_start * stride_st + kv_head * stride_sh

    pos_m = prefix + offs_m  # [BM] absolute query positions
    hi = prefix + tl.minimum(start_m + BLOCK_M, q_len)  # the tile's last query sees keys [0, hi)
    full_end = ((prefix + start_m + 1) // BLOCK_N) * BLOCK_N  # keys below: visible to all rows
    lo, mid = _window_blocks(prefix + start_m, hi, full_end, BLOCK_N, WINDOW)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if WINDOW > 0:
        acc, l_i, m_i = _attn_blocks(  # blocks the window's left edge crosses: masked
            acc, l_i, m_i, q, pos_m, k_base, v_base, ks_base, vs_base, lo, mid, stride_kt,
            stride_vt, stride_st, qk_scale, HEAD_DIM, BLOCK_N, True, PRECISION, KV_INT8,
            KV_GROUP, KV_FP8, WINDOW, SOFTCAP,
        )
    acc, l_i, m_i = _attn_blocks(  # blocks below the diagonal (in the window): no mask
        acc, l_i, m_i, q, pos_m, k_base, v_base, ks_base, vs_base, mid, full_end, stride_kt,
        stride_vt, stride_st, qk_scale, HEAD_DIM, BLOCK_N, False, PRECISION, KV_INT8, KV_GROUP,
        KV_FP8, WINDOW, SOFTCAP,
    )
    acc, l_i, m_i = _attn_blocks(  # blocks the tile's diagonal crosses: causal mask
        acc, l_i, m_i, q, pos_m, k_base, v_base, ks_base, vs_base, full_end, hi, stride_kt,
        stride_vt, stride_st, qk_scale, HEAD_DIM, BLOCK_N, True, PRECISION, KV_INT8, KV_GROUP,
        KV_FP8, WINDOW, SOFTCAP,
    )

    if WINDOW > 0:  # padding rows past q_len may see no key of [0, hi): 0 / 0 (not stored)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]  # [BM, D]
    o_ptrs = o_ptr + rows_q[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def _config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """Static (BLOCK_M, BLOCK_N, num_warps, num_stages) for H100, by head_dim and dtype."""
    if dtype == torch.float32:  # fp32 tiles are twice as big in shared memory
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return 128, 64, 8, 3
    return 64, 32, 8, 2


def _prefill_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [capacity, Hkv, D]
    v_cache: torch.Tensor,  # [capacity, Hkv, D]
    cu_q_lens: torch.Tensor,  # [S+1] int32
    seq_starts: torch.Tensor,  # [S] int32
    ctx_lens: torch.Tensor,  # [S] int32
    scale: float,
    max_q_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: torch.Tensor | None = None,  # INT8 caches: [capacity, Hkv, D / KV_GROUP] fp16
    v_scale: torch.Tensor | None = None,
    window: int = 0,  # > 0: sliding window (a Python int: a kernel constant)
    softcap: float = 0.0,  # > 0: scores capped to softcap * tanh(s / softcap) (a constant too)
) -> torch.Tensor:  # [T, H, D]
    """Launch the kernel; block_m / block_n override the static config (tests use small ones)."""
    n_heads, head_dim = q.shape[1], q.shape[2]
    n_kv_heads = k_cache.shape[1]
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of 2"
    assert n_heads % n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
    assert k_cache.shape[2] == head_dim and v_cache.shape == k_cache.shape
    # the kernel takes any token/head strides but needs a unit stride along head_dim
    q, k_cache, v_cache = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_cache, v_cache)
    )
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, D]
    n_seqs = seq_starts.shape[0]
    if q.shape[0] == 0 or n_seqs == 0 or max_q_len <= 0:
        return out
    bm, bn, warps, stages = _config(head_dim, q.dtype)
    bm, bn = block_m or bm, block_n or bn
    grid = (triton.cdiv(max_q_len, bm), n_seqs, n_heads)
    int8 = k_scale is not None
    assert not int8 or (k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1)
    scales = (k_scale, v_scale) if int8 else (out, out)  # placeholders without INT8
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out,
        cu_q_lens.to(torch.int32), seq_starts.to(torch.int32), ctx_lens.to(torch.int32),
        *scales, scale * _LOG2E.value,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        scales[0].stride(0), scales[0].stride(1),
        GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn,
        PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",  # tl.dot default for 16-bit
        KV_INT8=int8, KV_GROUP=KV_GROUP, KV_FP8=k_cache.dtype == FP8, WINDOW=window,
        SOFTCAP=float(softcap), num_warps=warps, num_stages=stages,
    )
    return out


def prefill_attention_reference(
    q: torch.Tensor,  # [T, H, D] new tokens of all sequences, concatenated
    k_cache: torch.Tensor,  # [capacity, Hkv, D]
    v_cache: torch.Tensor,  # [capacity, Hkv, D]
    cu_q_lens: torch.Tensor,  # [S+1] int32
    seq_starts: torch.Tensor,  # [S] int32
    ctx_lens: torch.Tensor,  # [S] int32, including the new tokens
    scale: float,
    window: int = 0,  # > 0: query at position p sees keys (p - window, p]
    softcap: float = 0.0,  # > 0: scores s capped to softcap * tanh(s / softcap)
) -> torch.Tensor:  # [T, H, D]
    """PyTorch reference: a loop over sequences, one masked SDPA each (the CPU path); with a
    softcap (SDPA cannot cap) the scores explicitly, as Gemma 2's eager attention."""
    out = torch.empty_like(q)
    cu, starts, lens = cu_q_lens.tolist(), seq_starts.tolist(), ctx_lens.tolist()
    for s, (start, n) in enumerate(zip(starts, lens, strict=True)):
        q0, q1 = cu[s], cu[s + 1]
        if q1 == q0:
            continue
        qs = q[q0:q1].transpose(0, 1)  # [H, q_len, D]
        ks = k_cache[start : start + n].transpose(0, 1).to(q.dtype)  # [Hkv, n, D]
        vs = v_cache[start : start + n].transpose(0, 1).to(q.dtype)  # [Hkv, n, D]
        q_pos = torch.arange(n - (q1 - q0), n, device=q.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(n, device=q.device)[None, :]  # [1, n]
        mask = k_pos <= q_pos  # [q_len, n]
        if window > 0:
            mask &= k_pos > q_pos - window
        if softcap > 0:
            ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], 0).float() for t in (ks, vs))
            sc = softcap * torch.tanh(qs.float() @ ks.transpose(1, 2) * scale / softcap)
            os_ = (sc.masked_fill(~mask, float("-inf")).softmax(-1) @ vs).to(q.dtype)
        else:
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                 enable_gqa=True)  # [H, q_len, D]
        out[q0:q1] = os_.transpose(0, 1)
    return out


def _visible_keys(m: int, n: int, window: int) -> tuple[int, torch.Tensor]:
    """(lo, bias [m, n - lo]): the m queries at positions n - m .. n - 1 see keys in [lo, n)
    at most; bias is 0 where query i sees key lo + j, else -inf (causal: j + lo <= n - m + i;
    window: j + lo > n - m + i - window)."""
    lo = max(0, n - m - window + 1) if window > 0 else 0
    hidden = torch.ones(m, n - lo, dtype=torch.bool).triu_(n - m - lo + 1)
    if window > 0:
        hidden |= torch.ones(m, n - lo, dtype=torch.bool).tril_(n - m - lo - window)
    return lo, torch.zeros(m, n - lo).masked_fill_(hidden, float("-inf"))


QUERY_BLOCK = 128  # CPU path: queries attended together; a block reads only the keys it sees


def _prefill_attention_cpu(q, k_cache, v_cache, cu_q_lens, seq_starts, ctx_lens, scale,
                           k_scale=None, v_scale=None, window=0, softcap=0.0):
    """The reference's contract, as batched GEMMs (MKL) per (sequence, block of QUERY_BLOCK
    queries); fp32 arithmetic. A block scores only the keys up to its last query (causal: about
    half of a long prompt's scores are never computed) and, with a window, from its first
    query's window on. INT8 caches (with scales) are dequantized one sequence's rows at a time.
    softcap > 0 caps the scores before the mask."""
    out = torch.empty_like(q)
    cu, starts, lens = cu_q_lens.tolist(), seq_starts.tolist(), ctx_lens.tolist()
    for s, (start, n) in enumerate(zip(starts, lens, strict=True)):
        q0, m = cu[s], cu[s + 1] - cu[s]
        if m == 0:
            continue
        lo = _visible_keys(min(m, QUERY_BLOCK), n - m + min(m, QUERY_BLOCK), window)[0]
        ks = kv_rows(k_cache, k_scale, start + lo, n - lo)  # [n - lo, Hkv, D]
        vs = kv_rows(v_cache, v_scale, start + lo, n - lo)
        for b0 in range(0, m, QUERY_BLOCK):
            b1 = min(m, b0 + QUERY_BLOCK)
            nb = n - m + b1  # the keys up to the block's last query
            out[q0 + b0:q0 + b1] = _attend(q[q0 + b0:q0 + b1], ks[:nb - lo], vs[:nb - lo],
                                           nb - lo, window, scale, softcap)
    return out


def _attend(q, ks, vs, n, window, scale, softcap):
    """Attention of q [m, H, D], the last m of n positions, over ks, vs [n, Hkv, D] (float32):
    every KV head at once, the g query heads sharing one as g * m rows of a batched GEMM."""
    m, num_heads, head_dim = q.shape
    kv_heads = ks.shape[1]
    group = num_heads // kv_heads
    lo, bias = _visible_keys(m, n, window)
    bias = bias.repeat(group, 1)  # [g*m, n - lo]
    qh = q.float().view(m, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qh = qh.reshape(kv_heads, group * m, head_dim)
    kt = ks[lo:].permute(1, 2, 0)  # [Hkv, D, n - lo]
    if softcap > 0:  # capped scores get the mask after the cap (tanh(-inf) = -1)
        sc = softcap * torch.tanh(torch.bmm(qh, kt) * (scale / softcap)) + bias
    else:
        sc = torch.baddbmm(bias, qh, kt, alpha=scale)  # [Hkv, g*m, n - lo]
    o = torch.bmm(torch.softmax(sc, dim=-1), vs[lo:].transpose(0, 1))  # [Hkv, g*m, D]
    return o.view(kv_heads, group, m, head_dim).permute(2, 0, 1, 3).reshape(q.shape).to(q.dtype)


def _kernel_takes(q, k_cache, v_cache, k_scale, window, softcap) -> bool:
    """Whether pipellm/kernels/cpu/prefill_attention.cpp runs this call: q float32, bf16 or float16
    and caches of its dtype (or fp16 under float32), INT8 (with scales) or FP8, unit stride along
    head_dim, head_dim a multiple of 16, no softcap, the C++ kernels at an x86 level
    (pipellm/kernels/cpu/isa.py). It runs bf16 caches without a window on AMX tiles at the amx
    level, other bf16 caches with coarse_p as bf16 products at the AVX-512 levels on a CPU with
    AVX512-BF16, else float32 vectors of the level (INT8, FP8 and fp16 converted as it packs
    each sequence's keys and values)."""
    caches = k_cache.dtype == v_cache.dtype and (
        k_cache.dtype == torch.int8 if k_scale is not None
        else k_cache.dtype in (*float_caches(q.dtype), FP8))
    if not (caches and q.dtype in _KERNEL_DTYPES and softcap == 0 and q.shape[-1] % 16 == 0
            and all(t.stride(-1) == 1 for t in (q, k_cache, v_cache))):
        return False
    ext = cpu_extension(q)
    return ext is not None and bool(ext.block_gemm_isa())


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_starts: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float | None = None,
    *,
    max_q_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    coarse_p: bool = False,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix plus themselves
    (with `window` > 0, a Python int, the query at position p sees keys (p - window, p] only).

    q [T, H, D] (sequence s's queries are q[cu_q_lens[s]:cu_q_lens[s+1]]); k_cache, v_cache
    [capacity, Hkv, D]; cu_q_lens [S+1], seq_starts [S], ctx_lens [S] int32 on q's device
    (ctx_lens include the new tokens). Returns [T, H, D] in q's dtype; scale defaults to D**-0.5.
    max_q_len: optional host-side max of the q lengths (sizes the grid without a device sync).
    With k_scale and v_scale the caches are INT8 (pipellm/kernels/kv_quant.py): Triton dequantizes
    in registers; off Triton the GEMM path dequantizes one sequence's rows at a time. FP8 caches
    (float8_e4m3fn, scale 1) convert likewise. softcap > 0 (Gemma 2; 0: none): each score
    s = scale * q.k becomes softcap * tanh(s / softcap) before the mask and softmax.
    coarse_p: bf16 may run at FlashAttention's precision, the softmax's numerators rounded to
    bf16 alone (AMX tiles then run one P V product instead of two; a CPU with AVX512-BF16 and
    no AMX runs bf16 products instead of float32 ones; the other paths ignore it): a pooling
    forward's choice, whose vectors need no more. Generation keeps its results bit for bit.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not use_triton(q):
        if _kernel_takes(q, k_cache, v_cache, k_scale, window, softcap):
            return cpu_extension(q).prefill_attention(
                q, k_cache, v_cache, cu_q_lens.to(torch.int32), seq_starts.to(torch.int32),
                ctx_lens.to(torch.int32), scale, window, k_scale, v_scale, coarse_p)
        if k_scale is not None or k_cache.dtype == FP8 or cpu_fast_path(q):
            return _prefill_attention_cpu(q, k_cache, v_cache, cu_q_lens, seq_starts, ctx_lens,
                                          scale, k_scale, v_scale, window, softcap)
        return prefill_attention_reference(q, k_cache, v_cache, cu_q_lens, seq_starts, ctx_lens,
                                           scale, window, softcap)
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max().item()) if len(cu_q_lens) > 1 else 0
    return _prefill_attention_triton(q, k_cache, v_cache, cu_q_lens, seq_starts, ctx_lens, scale,
                                     max_q_len, k_scale=k_scale, v_scale=v_scale, window=window,
                                     softcap=softcap)
