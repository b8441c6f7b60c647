"""Decode attention (one query per sequence) over the contiguous KV cache: flash-decoding.

Cache layout, per layer: K and V of shape [capacity, n_kv_heads, head_dim]; sequence b owns the
slots [seq_starts[b], seq_starts[b] + seq_lens[b]), the current token's K/V already written.
GQA: query head h reads KV head h // (n_heads // n_kv_heads).

Triton path, two launches:
    1. `_decode_split_kernel`, grid (B, n_kv_heads, num_splits): each program reads its share of
       one sequence's KV rows of ONE kv head once, for all the query heads of that GQA group,
       in BLOCK_N chunks with an online softmax in fp32 (exp2 domain), and writes the partial
       output (normalized) and its log2-sum-exp to a workspace. With num_splits == 1 it writes
       the final output directly and step 2 is skipped.
    2. `_decode_combine_kernel`, grid (B, n_heads): merges the splits' partials.
With a fused tiling (`Tiling.fused`) step 2 happens inside step 1: each program counts its
arrival on its (sequence, kv head)'s counter, and the last to arrive merges the group's splits
and resets the counter to 0 (pipellm/kernels/arrivals.py).

Sliding window (WINDOW > 0, a per-layer constant): the query at position p = len - 1 sees the
keys at positions (p - WINDOW, p], transformers' `sliding_window_overlay` (kv > q - window).
The splits share out only those min(len, WINDOW) keys: the rows before them are never read.

Logit soft-capping (SOFTCAP > 0, Gemma 2's `attn_logit_softcapping`): each score s = scale * q.k
becomes SOFTCAP * tanh(s / SOFTCAP) before the mask and softmax (transformers' Gemma 2 eager
attention). The kernel caps its exp2-domain scores s * log2(e) with the cap SOFTCAP * log2(e):
the same value, times log2(e).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pipellm.kernels import arrivals
from pipellm.kernels.dispatch import cpu_extension, use_triton
from pipellm.kernels.kv_quant import FP8, KV_GROUP, kv_rows

_MAX_SPLITS = 64
_TARGET_WAVES = 4  # split until B * n_kv_heads * num_splits >= this many waves of programs
_DEFAULT_SMS = 132  # H100 SXM; used where no CUDA device can be asked
# Tests (and experiments) force a split count: > 0 overrides the heuristic.
_FORCED_SPLITS = int(os.environ.get("PIPELLM_DECODE_SPLITS", "0"))


@dataclass(frozen=True)
class Tiling:
    """One launch shape of the split kernel: KV rows per inner-loop chunk, warps, pipeline
    stages, and the fewest tokens of the longest sequence that a split covers."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    min_split_tokens: int = 256
    fused: bool = False  # the last split of a group merges the partials (no second launch)


# by the cache's kind; measured on an H200 (docs/benchmarks.md, bench/gpu_tune.py)
TILINGS = {"16bit": Tiling(min_split_tokens=64), "int8": Tiling(num_stages=3), "fp8": Tiling()}


@triton.jit
def _split_len(n, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of a sequence of n tokens: an equal share rounded up to whole chunks."""
    return tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _tanh(x):
    """sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow (no tl tanh everywhere)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _qk(q, k, USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """q [BLOCK_H, D], k [BLOCK_N, D] -> q @ k^T [BLOCK_H, BLOCK_N] fp32."""
    if USE_DOT:
        if UPCAST_DOT:  # the interpreter's tl.dot cannot do bf16: compute it in fp32 there
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:  # "ieee" keeps fp32 inputs exact (no tf32); fp16/bf16 run on tensor cores
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:  # one query head per kv head (MHA): a broadcast multiply-sum beats a padded dot
        s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    return s


@triton.jit
def _pv(p, v, USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """p [BLOCK_H, BLOCK_N] fp32, v [BLOCK_N, D] -> p @ v [BLOCK_H, D] fp32."""
    if USE_DOT:
        if UPCAST_DOT:
            o = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            o = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        o = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    return o


@triton.jit
def _dequant(x, scales, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, KV_GROUP: tl.constexpr):
    """int8 x [BLOCK_N, D] times its groups' scales [BLOCK_N, D / KV_GROUP] -> fp32 [BLOCK_N, D]:
    each scale loaded once and broadcast over its group (a per-value scale tile of fp32 would
    hold 2 x BLOCK_N x D more registers)."""
    x = tl.reshape(x.to(tl.float32), (BLOCK_N, HEAD_DIM // KV_GROUP, KV_GROUP))
    return tl.reshape(x * scales.to(tl.float32)[:, :, None], (BLOCK_N, HEAD_DIM))


@triton.jit
def _int8_to_f16(x, scales, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 KV_GROUP: tl.constexpr, PTX: tl.constexpr):
    """int8 x [BLOCK_N, D] times its groups' fp16 scales -> fp16, the product rounded once (11
    bits, finer than bf16's 8). PTX (CUDA), four values a register: two byte permutes make the
    fp16 bits 0x6400 | (x + 128) = 1024 + x + 128, one packed subtract of 1152 a pair leaves x
    exactly (FasterTransformer's conversion), one packed multiply a pair by the scales (which
    Triton packs in pairs for free): 1.75 instructions a value. Not `is_pure`: that keeps
    Triton from moving it past the layout change into the dot's operand, where it would
    convert the values one byte at a time."""
    s = tl.reshape(tl.broadcast_to(scales[:, :, None], (BLOCK_N, HEAD_DIM // KV_GROUP, KV_GROUP)),
                   (BLOCK_N, HEAD_DIM))
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, m;
            xor.b32 t, $2, 0x80808080;
            mov.b32 m, 0x64806480;
            prmt.b32 $0, t, 0x64646464, 0x5150;
            prmt.b32 $1, t, 0x64646464, 0x5352;
            sub.f16x2 $0, $0, m;
            sub.f16x2 $1, $1, m;
            mul.f16x2 $0, $0, $3;
            mul.f16x2 $1, $1, $4;
            }""",
            constraints="=r,=r,r,r,r", args=[x, s], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(tl.float32).to(tl.float16) * s


@triton.jit
def _fp8_to_f16(x, PTX: tl.constexpr):
    """e4m3 x -> fp16, exactly. PTX (CUDA): one packed conversion a pair, kept before the layout
    change into the dot's operand as `_int8_to_f16` is (where Triton would place its own
    conversion, it loads the bytes one at a time from shared memory)."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)
    return x.to(tl.float16)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, starts_ptr, lens_ptr,  # q [B, H, D]; k, v [capacity, Hkv, D]; [B] x2
    out_ptr, part_o_ptr, part_lse_ptr,  # out [B, H, D]; part_o [B, H, S, D]; part_lse [B, H, S]
    ks_ptr, vs_ptr,  # KV_INT8: fp16 scales [capacity, Hkv, D / KV_GROUP] (K's and V's layout)
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
    stride_st, stride_sh,  # KV_INT8: the scales' row and head strides
    qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr, DIRECT: tl.constexpr,
    KV_INT8: tl.constexpr, KV_GROUP: tl.constexpr,  # int8 K/V, one scale per KV_GROUP values
    KV_FP8: tl.constexpr = False,  # e4m3 K/V (pipellm/kernels/kv_quant.py)
    WINDOW: tl.constexpr = 0,  # > 0: attend only the last WINDOW keys (sliding window)
    SOFTCAP: tl.constexpr = 0.0,  # > 0: scores s -> SOFTCAP * tanh(s / SOFTCAP)
    F16: tl.constexpr = False,  # quantized K/V: the dots in fp16, q pre-scaled (see launcher)
    PTX: tl.constexpr = False,  # compiled for CUDA: inline PTX allowed (not interpreted)
    counter_ptr=None,  # FUSED: int32 [>= B * n_kv_heads], zero between launches
    FUSED: tl.constexpr = False, SPLITS_PAD: tl.constexpr = 1,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    start = tl.load(starts_ptr + b).to(tl.int64)
    n = tl.load(lens_ptr + b)
    first = n * 0  # the first visible token: the query (position n - 1) sees [first, n)
    if WINDOW > 0:
        first = tl.maximum(n - WINDOW, 0)
    split_len = _split_len(n - first, num_splits, BLOCK_N)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, n)  # tokens [lo, hi) of b; empty (lo >= hi) for short b

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] query head within the group (padded)
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    h_mask = offs_h < GROUP
    heads = kvh * GROUP + offs_h  # [BLOCK_H] query heads
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None], other=0.0)  # [BLOCK_H, D]
    if F16:  # the scale folded into q keeps it within fp16's range
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
    k_base = k_ptr + kvh * stride_kh + offs_d[None, :]  # [1, D]
    v_base = v_ptr + kvh * stride_vh + offs_d[None, :]
    s_off = kvh * stride_sh + tl.arange(0, HEAD_DIM // KV_GROUP)[None, :]  # [1, D / KV_GROUP]

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)  # unnormalized output
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + offs_n  # [BLOCK_N] token positions
        t_mask = t < hi
        rows = start + t  # [BLOCK_N] int64 cache slots
        k = tl.load(k_base + rows[:, None] * stride_kt, mask=t_mask[:, None], other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vt, mask=t_mask[:, None], other=0.0)
        if KV_INT8:  # dequantize in registers: int8 x its group's fp16 scale, in q's dtype
            s_ptrs = rows[:, None] * stride_st + s_off  # [BLOCK_N, D / KV_GROUP]
            k_sc = tl.load(ks_ptr + s_ptrs, mask=t_mask[:, None], other=0.0)
            v_sc = tl.load(vs_ptr + s_ptrs, mask=t_mask[:, None], other=0.0)
            if F16:
                k = _int8_to_f16(k, k_sc, BLOCK_N, HEAD_DIM, KV_GROUP, PTX)
                v = _int8_to_f16(v, v_sc, BLOCK_N, HEAD_DIM, KV_GROUP, PTX)
            else:
                k = _dequant(k, k_sc, BLOCK_N, HEAD_DIM, KV_GROUP).to(q.dtype)
                v = _dequant(v, v_sc, BLOCK_N, HEAD_DIM, KV_GROUP).to(q.dtype)
        if KV_FP8:  # e4m3 values, scale 1
            if F16:
                k, v = _fp8_to_f16(k, PTX), _fp8_to_f16(v, PTX)
            else:
                k = k.to(tl.float32).to(q.dtype)
                v = v.to(tl.float32).to(q.dtype)
        s = _qk(q, k, USE_DOT, UPCAST_DOT)  # [BLOCK_H, BLOCK_N], log2 domain
        if not F16:
            s = s * qk_scale
        if SOFTCAP > 0:  # cap the true score: in the log2 domain the cap is SOFTCAP * log2(e)
            s = (SOFTCAP * 1.4426950408889634) * _tanh(s / (SOFTCAP * 1.4426950408889634))
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
        if FUSED:  # the last of the group's programs to arrive merges its splits
            tl.debug_barrier()  # every thread's partial stores come before the arrival
            counter = counter_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:
                tl.debug_barrier()
                tl.store(counter, 0)  # zero again for the next launch (and graph replay)
                used = tl.cdiv(n - first, split_len)  # non-empty splits of b (>= 1)
                for g in range(GROUP):
                    _merge(part_o_ptr, part_lse_ptr, out_ptr + b * stride_ob,
                           kvh * GROUP + g, b * tl.num_programs(1) * GROUP, num_splits, used,
                           stride_oh, HEAD_DIM, SPLITS_PAD)


@triton.jit
def _merge(part_o_ptr, part_lse_ptr, out_ptr, h, row0, num_splits, used, stride_oh,
           HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Head h's output from its first `used` splits' partials (rows row0 + h: of its sequence);
    out_ptr points at the sequence's output. Loads bypass L1: other programs wrote them."""
    offs_s = tl.arange(0, SPLITS_PAD)  # [S_PAD]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    s_mask = offs_s < used
    row = (row0 + h) * num_splits + offs_s  # [S_PAD]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"),
                  cache_modifier=".cg")  # [S_PAD]
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None],
                other=0.0, cache_modifier=".cg")  # [S_PAD, D]
    w = tl.exp2(lse - tl.max(lse, axis=0))  # [S_PAD], 0 for skipped splits
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)  # [D]
    tl.store(out_ptr + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _decode_combine_kernel(
    part_o_ptr, part_lse_ptr, lens_ptr, out_ptr,  # [B, H, S, D] fp32, [B, H, S] fp32, [B], out
    stride_ob, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_PAD: tl.constexpr,
    WINDOW: tl.constexpr = 0,  # the split kernel's: the splits shared out min(n, WINDOW) keys
):
    b, h = tl.program_id(0), tl.program_id(1)
    n = tl.load(lens_ptr + b)
    if WINDOW > 0:
        n = tl.minimum(n, WINDOW)
    used = tl.cdiv(n, _split_len(n, num_splits, BLOCK_N))  # non-empty splits of b (>= 1)
    _merge(part_o_ptr, part_lse_ptr, out_ptr + b * stride_ob, h, b * tl.num_programs(1),
           num_splits, used, stride_oh, HEAD_DIM, SPLITS_PAD)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(batch: int, n_kv_heads: int, max_seq_len: int, device: torch.device,
                min_split_tokens: int = Tiling.min_split_tokens) -> int:
    """Splits per sequence: enough programs for _TARGET_WAVES waves over the SMs, but each split
    of the longest sequence keeps >= min_split_tokens tokens; rounded down to a power of 2."""
    if _FORCED_SPLITS > 0:
        return _FORCED_SPLITS
    sms = _DEFAULT_SMS  # CPU (interpreter): plan as for an H100
    if device.type == "cuda" and torch.cuda.is_available():
        sms = _sm_count(torch.cuda.current_device() if device.index is None else device.index)
    want = triton.cdiv(_TARGET_WAVES * sms, batch * n_kv_heads)  # 1 once the batch fills it
    cap = triton.cdiv(max_seq_len, min_split_tokens)
    splits = max(1, min(want, cap, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # round down to a power of 2


def _check_inputs(q, k_cache, v_cache, seq_starts, seq_lens) -> None:
    batch, n_heads, head_dim = q.shape
    _, n_kv_heads, kv_dim = k_cache.shape
    if head_dim not in (16, 32, 64, 128, 256) or kv_dim != head_dim:
        raise ValueError(f"decode_attention: head_dim must be a power of 2 in [16, 256] and "
                         f"equal for q and K/V, got q {head_dim}, K/V {kv_dim}")
    if n_heads % n_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: n_heads {n_heads} must be a multiple of n_kv_heads "
                         f"{n_kv_heads}; K {tuple(k_cache.shape)} vs V {tuple(v_cache.shape)}")
    if seq_starts.shape != (batch,) or seq_lens.shape != (batch,):
        raise ValueError("decode_attention: seq_starts and seq_lens must have shape [B]")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("decode_attention: q, k_cache, v_cache need a contiguous last dim")


def _decode_attention_triton(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [capacity, Hkv, D]
    v_cache: torch.Tensor,  # [capacity, Hkv, D]
    seq_starts: torch.Tensor,  # [B] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,  # None: `_num_splits` heuristic
    k_scale: torch.Tensor | None = None,  # INT8 caches: [capacity, Hkv, D / KV_GROUP] fp16
    v_scale: torch.Tensor | None = None,
    window: int = 0,  # > 0: only the last `window` keys (a Python int: a kernel constant)
    softcap: float = 0.0,  # > 0: scores capped to softcap * tanh(s / softcap) (a constant too)
    tiling: Tiling | None = None,  # None: TILINGS' entry for the cache's kind
) -> torch.Tensor:  # [B, H, D], q.dtype
    _check_inputs(q, k_cache, v_cache, seq_starts, seq_lens)
    int8 = k_scale is not None
    fp8 = k_cache.dtype == FP8
    if int8 and (k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1):
        raise ValueError("decode_attention: K and V scales need one layout, contiguous last dim")
    batch, n_heads, head_dim = q.shape
    if tiling is None:
        tiling = TILINGS["int8" if int8 else "fp8" if fp8 else "16bit"]
        if head_dim > 128:  # halve the chunk: a [64, 256] tile spills registers on sm_90
            tiling = replace(tiling, block_n=tiling.block_n // 2)
    n_kv_heads = k_cache.shape[1]
    group = n_heads // n_kv_heads
    if num_splits is None:  # a window caps the keys any sequence reads
        num_splits = _num_splits(batch, n_kv_heads, min(max_seq_len, window or max_seq_len),
                                 q.device, tiling.min_split_tokens)
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
    scales = (k_scale, v_scale) if int8 else (out, out)  # placeholders without INT8
    counters = None
    if tiling.fused and num_splits > 1:
        counters = arrivals.counters(q.device, batch * n_kv_heads)
    _decode_split_kernel[(batch, n_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_starts, seq_lens, out, part_o, part_lse, *scales,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        scales[0].stride(0), scales[0].stride(1), scale * math.log2(math.e),
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_N=tiling.block_n,
        USE_DOT=use_dot, UPCAST_DOT=not q.is_cuda and q.dtype == torch.bfloat16,
        DIRECT=num_splits == 1, KV_INT8=int8, KV_GROUP=KV_GROUP, KV_FP8=fp8, WINDOW=window,
        SOFTCAP=float(softcap),
        F16=(int8 or fp8) and q.dtype in (torch.bfloat16, torch.float16), PTX=q.is_cuda,
        counter_ptr=out if counters is None else counters, FUSED=counters is not None,
        SPLITS_PAD=1 if counters is None else triton.next_power_of_2(num_splits),
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    if num_splits > 1 and counters is None:
        _decode_combine_kernel[(batch, n_heads)](
            part_o, part_lse, seq_lens, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_N=tiling.block_n,
            SPLITS_PAD=triton.next_power_of_2(num_splits), WINDOW=window, num_warps=4,
        )
    return out


def decode_attention_reference(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [capacity, Hkv, D]
    v_cache: torch.Tensor,  # [capacity, Hkv, D]
    seq_starts: torch.Tensor,  # [B] int
    seq_lens: torch.Tensor,  # [B] int, >= 1
    scale: float,
    k_scale: torch.Tensor | None = None,  # INT8 caches: [capacity, Hkv, D / KV_GROUP] fp16
    v_scale: torch.Tensor | None = None,
    window: int = 0,  # > 0: only the last `window` keys
    softcap: float = 0.0,  # > 0: scores s = scale * q.k capped to softcap * tanh(s / softcap)
) -> torch.Tensor:  # [B, H, D]
    """Loop over sequences (a padded gather would copy max_len x B KV rows: slower on CPU).
    Each KV head's query group is one [G, D] x [D, n] product: no repeated K/V, no SDPA call
    overhead (on a CPU this loop is most of a decode step). INT8 caches are dequantized one
    sequence's rows at a time."""
    B, H, D = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty_like(q)
    for b, (s, n) in enumerate(zip(seq_starts.tolist(), seq_lens.tolist(), strict=True)):
        if 0 < window < n:  # the query (position n - 1) sees positions (n - 1 - window, n - 1]
            s, n = s + n - window, window
        kb = kv_rows(k_cache, k_scale, s, n).permute(1, 2, 0)  # [Hkv, D, n]
        vb = kv_rows(v_cache, v_scale, s, n).transpose(0, 1)  # [Hkv, n, D]
        qb = q[b].view(hkv, H // hkv, D).float()  # [Hkv, G, D]
        s = torch.matmul(qb, kb) * scale  # [Hkv, G, n]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        p = torch.softmax(s, dim=-1)
        out[b] = torch.matmul(p, vb).view(H, D).to(q.dtype)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_starts: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Single-query attention of each sequence over its cached tokens (all of them, or with
    `window` > 0 the last `window`: keys at positions (p - window, p] for the query at p).

    q [B, n_heads, head_dim]; k_cache, v_cache [capacity, n_kv_heads, head_dim] (one layer;
    n_heads a multiple of n_kv_heads, head_dim a power of 2); seq_starts, seq_lens int32 [B] on
    q's device: sequence b's K/V are the slots [seq_starts[b], seq_starts[b] + seq_lens[b]),
    seq_lens >= 1, the current token's K/V already written. scale defaults to head_dim**-0.5.
    max_seq_len: optional host-side max(seq_lens), sizes the Triton split grid without a device
    sync (computed with .item() when None). Returns [B, n_heads, head_dim] in q's dtype.
    Triton (flash-decoding) where `pipellm.kernels.dispatch.use_triton(q)`, else the C++ CPU kernel
    (pipellm/kernels/cpu/decode_attention.cpp) where it builds, else the PyTorch reference. With
    k_scale and v_scale the caches are INT8 (pipellm/kernels/kv_quant.py): every path reads them,
    dequantizing in registers (Triton, C++) or one sequence's rows (the reference). FP8 caches
    (float8_e4m3fn, scale 1) convert in registers (Triton) or in the reference (off Triton);
    fp16 caches under float32 q (off Triton) convert as they are read.
    `window` is a Python int (a Triton constant: CUDA graphs capture it per layer).
    `softcap` > 0 (Gemma 2's attn_logit_softcapping; 0: none, a Triton constant too) caps each
    score s = scale * q.k to softcap * tanh(s / softcap) before the softmax, in every path.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if not use_triton(q) and k_cache.dtype != FP8 and (ext := cpu_extension(q)) is not None:
        return ext.decode_attention(q, k_cache, v_cache, seq_starts, seq_lens, scale, k_scale,
                                    v_scale, window, softcap)
    if not use_triton(q):
        return decode_attention_reference(q, k_cache, v_cache, seq_starts, seq_lens, scale,
                                          k_scale, v_scale, window, softcap)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 1
    return _decode_attention_triton(q, k_cache, v_cache, seq_starts, seq_lens, scale, max_seq_len,
                                    k_scale=k_scale, v_scale=v_scale, window=window,
                                    softcap=softcap)
