"""W4A16 GEMM: group-wise INT4 weights (pipellm/kernels/int4_weight.py's layout) times float
activations. The Triton kernel, launcher, PyTorch reference, and `prepare_int4` / `int4_gemm`:
the layout each device's path wants, made once at load, and the call that runs it.

The Triton kernel reads the packed bytes and the group's scale and min per K block and
dequantizes in registers: the weight is never materialized in float. On a CPU the paths are in
pipellm/kernels/int4_cpu.py; on CUDA with bf16 activations, tinygemm's tiles serve steps of few rows
(pipellm/kernels/int4_tiles.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipellm.kernels import arrivals
from pipellm.kernels.cpu import extension
from pipellm.kernels.dispatch import block_gemm_extension, cpu_fast_path, use_triton
from pipellm.kernels.int4_cpu import (
    Int4Blocks,
    Int4Cpu,
    int4_gemm_cpu,
    pack_int4_blocks,
    pack_int4_cpu,
)
from pipellm.kernels.int4_tiles import Int4Tiles, int4_tiles_gemm, pack_tiles, tiles_fit
from pipellm.kernels.int4_weight import Int4Weight, dequantize_int4


@triton.jit
def _nibbles(q, dtype: tl.constexpr):
    """uint8 values 0..15 as `dtype`, plus `_nibble_offset(dtype)`: bf16 and fp16 by their bits
    alone (0x4300 | q is the bf16 128 + q, 0x6400 | q the fp16 1024 + q), no conversion
    instruction (those run at a quarter of the rate and bound this kernel); fp32 converted."""
    if dtype == tl.bfloat16:
        return (q.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
    if dtype == tl.float16:
        return (q.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    return q.to(tl.float32).to(dtype)


def _nibble_asm(magic: int) -> tl.constexpr:
    """PTX for four packed bytes: their low nibbles as 16-bit floats (two registers), then their
    high nibbles; each value's bits are magic's byte over the nibble, `_nibbles`' values."""
    return tl.constexpr(f"""{{
        .reg .b32 t, u;
        and.b32 t, $4, 0x0F0F0F0F;
        shr.b32 u, $4, 4;
        and.b32 u, u, 0x0F0F0F0F;
        prmt.b32 $0, t, {magic:#x}, 0x5150;
        prmt.b32 $1, t, {magic:#x}, 0x5352;
        prmt.b32 $2, u, {magic:#x}, 0x5150;
        prmt.b32 $3, u, {magic:#x}, 0x5352;
        }}""")


_NIBBLES_BF16, _NIBBLES_F16 = _nibble_asm(0x43434343), _nibble_asm(0x64646464)


@triton.jit
def _nibble_pairs(b, dtype: tl.constexpr, PTX: tl.constexpr):
    """(low, high) nibbles of uint8 b as `_nibbles` makes them. PTX (CUDA, bf16 or fp16):
    seven instructions per four bytes, kept before the layout change into the dot's operand
    (not `is_pure`), where Triton's own byte ops took about twice as many."""
    if PTX:
        asm: tl.constexpr = _NIBBLES_BF16 if dtype == tl.bfloat16 else _NIBBLES_F16
        lo, hi = tl.inline_asm_elementwise(asm=asm, constraints="=r,=r,=r,=r,r", args=[b],
                                           dtype=(tl.int16, tl.int16), is_pure=False, pack=4)
        return lo.to(dtype, bitcast=True), hi.to(dtype, bitcast=True)
    return _nibbles(b & 0xF, dtype), _nibbles(b >> 4, dtype)


def _nibble_offset(dtype: torch.dtype) -> float:
    """What `_nibbles` adds to each value in `dtype`."""
    return {torch.bfloat16: 128.0, torch.float16: 1024.0}.get(dtype, 0.0)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,  # [M, K] activations, row stride stride_x
    qw_ptr,  # [N, K // 2] uint8 packed weight
    s_ptr, m_ptr,  # [N, K // G] scales, mins
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype (SPLIT_K > 1: written by the last split when FUSED)
    part_ptr,  # SPLIT_K > 1: fp32 partial sums [SPLIT_K, M, N]
    counter_ptr,  # FUSED: int32 [>= tiles], zero between launches (pipellm/kernels/arrivals.py)
    M, N, K, stride_x,
    G: tl.constexpr,  # group size, a multiple of BLOCK_K: a K block lies in one group
    OFFSET: tl.constexpr,  # `_nibble_offset` of x's dtype
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 activations (no TF32), else the default
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K; each takes every SPLIT_K-th K block
    FUSED: tl.constexpr = False,  # the last split of a tile adds the partials (one launch)
    PTX: tl.constexpr = False,  # compiled for CUDA: inline PTX allowed (not interpreted)
):
    """Per K block, with s and m its group's scale and min per row n:
    sum_k x[k] (q[n, k] s + m) = s (x_even . q_low + x_odd . q_high) + m sum_k x[k]:
    the nibbles go into the dot as they are (0..15, exact in any float dtype; plus OFFSET, taken
    back through the min: s (dots - OFFSET sum x) + m sum x) and the scale and min apply once per
    block, so no dequantized weight tile is ever formed."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    split = tl.program_id(2)
    rb = tl.arange(0, BLOCK_K // 2)  # [BK / 2] byte offsets: k = 2 rb (low), 2 rb + 1 (high)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x + 2 * rb[None, :]  # [BM, BK / 2]
    w_rows = qw_ptr + rn[:, None].to(tl.int64) * (K // 2) + rb[None, :]  # [BN, BK / 2]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):  # K % BLOCK_K == 0
        x_even = tl.load(x_rows + k0, mask=m_ok[:, None], other=0.0)  # [BM, BK / 2]
        x_odd = tl.load(x_rows + k0 + 1, mask=m_ok[:, None], other=0.0)
        b = tl.load(w_rows + k0 // 2, mask=n_ok[:, None], other=0)  # [BN, BK / 2] uint8
        lo, hi = _nibble_pairs(b, x_even.dtype, PTX)
        dots = tl.dot(x_even, tl.trans(lo), input_precision=PRECISION)
        dots = tl.dot(x_odd, tl.trans(hi), dots, input_precision=PRECISION)  # [BM, BN]
        g = rn.to(tl.int64) * (K // G) + k0 // G  # [BN]
        s = tl.load(s_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
        mn = tl.load(m_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
        x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)  # [BM]
        acc += dots * s[None, :] + x_sum[:, None] * (mn - OFFSET * s)[None, :]
    out = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        _store(acc, out_ptr + out, mask, bias_ptr + rn, n_ok, HAS_BIAS)
    else:
        tl.store(part_ptr + split.to(tl.int64) * M * N + out, acc, mask=mask)
        if FUSED:  # the last of the tile's splits to arrive adds them up
            tl.debug_barrier()  # every thread's partial stores come before the arrival
            counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
                tl.debug_barrier()
                tl.store(counter, 0)  # zero again for the next launch (and graph replay)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for i in tl.static_range(SPLIT_K):  # other programs wrote them: bypass L1
                    acc += tl.load(part_ptr + i * M * N + out, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                _store(acc, out_ptr + out, mask, bias_ptr + rn, n_ok, HAS_BIAS)


@triton.jit
def _store(acc, out_ptrs, mask, bias_ptrs, n_ok, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] (+ bias [BN]) stored in the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_sum_kernel(
    part_ptr, bias_ptr, out_ptr,  # [SPLIT_K, M * N] fp32, [N], [M * N] in x's dtype
    MN, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < MN
    splits = tl.arange(0, SPLITS_PAD)  # SPLIT_K rounded up to a power of 2
    acc = tl.sum(tl.load(part_ptr + splits[:, None] * MN + r[None, :],
                         mask=(splits < SPLIT_K)[:, None] & ok[None, :], other=0.0), axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + r % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, s_ptr, m_ptr, out_ptr,  # [N, K // 2] uint8, [N, K // G] x2, [N, K] out
    N, K, G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # G % BLOCK_K == 0
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    k0 = tl.program_id(1) * BLOCK_K
    n_ok = rn < N
    b = tl.load(qw_ptr + rn[:, None].to(tl.int64) * (K // 2) + k0 // 2
                + tl.arange(0, BLOCK_K // 2)[None, :], mask=n_ok[:, None], other=0)
    q = tl.join(b & 0xF, b >> 4).reshape(BLOCK_N, BLOCK_K)  # k even, odd, ...
    g = rn.to(tl.int64) * (K // G) + k0 // G  # [BN]
    s = tl.load(s_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
    mn = tl.load(m_ptr + g, mask=n_ok, other=0.0).to(tl.float32)
    w = q.to(tl.float32) * s[:, None] + mn[:, None]
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + k0 + tl.arange(0, BLOCK_K)[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])


def dequantize_int4_triton(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] matrix `w` stands for, in `dtype` (each value rounded once from float32)."""
    (n, k), g = w.shape, w.group_size
    out = torch.empty(n, k, dtype=dtype, device=w.packed.device)
    block_k = min(g, 128)
    _int4_dequant_kernel[(triton.cdiv(n, 64), k // block_k)](
        w.packed, w.scales, w.mins, out, n, k, G=g, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)
    return out


@dataclass(frozen=True)
class GemmTiling:
    """One launch shape of `_int4_gemm_kernel`. split_k > 1 splits K over that many programs,
    their fp32 partial sums added by `_split_k_sum_kernel`, or with `fused` by each tile's last
    split to finish: at a few rows the N tiles alone are too few programs to keep the memory
    system busy."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    fused: bool = False  # split_k > 1: the last split of a tile adds the partials (one launch)


SMALL_M = 16  # rows up to which the GEMV tiling (split along K) runs; above, dequantize + cuBLAS
# The GEMV tiling: 128 columns by 64 of K a program, K split until about this many programs
# (4 per H100 SM), each keeping >= 4 K blocks: split 16 for 4096x4096 and 8 for 14336x4096, the
# fastest shapes of bench/gpu_tune.py on an H200 (docs/benchmarks.md).
_GEMV_N, _GEMV_K, _TARGET_PROGRAMS = 128, 64, 4 * 132

TUNED: dict[tuple[int, int], GemmTiling] = {}  # (n, k) -> measured tiling for m <= SMALL_M


def gemm_tiling(m: int, n: int, k: int, g: int) -> GemmTiling:
    """The fused kernel's tiling for an [m, k] x [n, k]^T product with groups of g."""
    if m > SMALL_M:
        return GemmTiling(64, 64, min(g, 64))
    if (n, k) in TUNED:
        return TUNED[n, k]
    block_k = min(g, _GEMV_K)
    tiles, blocks = triton.cdiv(n, _GEMV_N), k // block_k
    split = 1
    while tiles * split < _TARGET_PROGRAMS and blocks >= 8 * split:  # >= 4 blocks a split
        split *= 2
    return GemmTiling(16, _GEMV_N, block_k, split)


def int4_gemm_triton(x: torch.Tensor, w: Int4Weight, bias=None,
                     tiling: GemmTiling | None = None) -> torch.Tensor:
    """Triton implementation of `int4_gemm`. Up to SMALL_M rows (or with a `tiling`) the fused
    kernel; above, the weight dequantized into a scratch matrix and cuBLAS's GEMM (a prefill's
    rows: the fused kernel ran at 0.04-0.06x cuBLAS bf16 there on an H200)."""
    (n, k), g = w.shape, w.group_size
    if x.shape[-1] != k:
        raise ValueError(f"K mismatch: activations {tuple(x.shape)}, INT4 weight {(n, k)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if tiling is None and m > SMALL_M:
        return F.linear(x2, dequantize_int4_triton(w, x.dtype), bias).view(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    t = tiling or gemm_tiling(m, n, k, g)
    if g % t.block_k or t.block_k < 32:
        raise ValueError(f"INT4 GEMM: block_k {t.block_k} must divide the group {g} and be >= 32")
    part = out if t.split_k == 1 else torch.empty(t.split_k, m, n, dtype=torch.float32,
                                                  device=x.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split_k)
    counters = None
    if t.fused and t.split_k > 1:
        counters = arrivals.counters(x.device, grid[0] * grid[1])
    bias_or_out = bias if bias is not None else out
    _int4_gemm_kernel[grid](x2, w.packed, w.scales, w.mins, bias_or_out, out, part,
                            out if counters is None else counters, m, n, k, x2.stride(0), G=g,
                            OFFSET=_nibble_offset(x.dtype), HAS_BIAS=bias is not None,
                            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                            SPLIT_K=t.split_k, FUSED=counters is not None,
                            PTX=x.is_cuda and x.dtype in (torch.bfloat16, torch.float16),
                            num_warps=t.num_warps, num_stages=t.num_stages)
    if t.split_k > 1 and counters is None:
        _split_k_sum_kernel[(triton.cdiv(m * n, 1024),)](
            part, bias_or_out, out, m * n, n, HAS_BIAS=bias is not None, SPLIT_K=t.split_k,
            SPLITS_PAD=triton.next_power_of_2(t.split_k), BLOCK=1024, num_warps=4)
    return out.view(*x.shape[:-1], n)


def int4_gemm_ref(x: torch.Tensor, w: Int4Weight, bias=None) -> torch.Tensor:
    """PyTorch reference: x @ dequantize_int4(w)^T (+ bias) in float32, rounded to x's dtype."""
    out = x.float() @ dequantize_int4(w).t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@dataclass
class Int4Cuda:
    """An Int4Weight on CUDA with bf16 activations, with tinygemm's tiles of it beside
    (pipellm/kernels/int4_tiles.py): steps of up to TINYGEMM_ROWS rows run tinygemm, the others the
    Triton path, each where it was measured faster (docs/benchmarks.md, GPU round four). The tiles
    double the INT4 bytes: still half of bf16's."""

    weight: Int4Weight
    tiles: Int4Tiles


TINYGEMM_ROWS = 8  # tinygemm beat the Triton GEMV at 1-8 rows on an H200, lost at 16


def prepare_int4(w: Int4Weight) -> Int4Weight | Int4Cpu | Int4Blocks | Int4Cuda:
    """The weight in the layout the call path wants, made once at load: on CPU (`--kernels
    auto`) repacked for the C++ block GEMM, or for PyTorch's without it; on CUDA with bf16
    scales, with tinygemm's tiles beside it where the shape fits; else as is (Triton, the
    reference)."""
    if w.packed.is_cuda and use_triton(w.packed) and tiles_fit(*w.shape, w.group_size,
                                                               w.scales.dtype):
        return Int4Cuda(w, pack_tiles(w))
    if not cpu_fast_path(w.packed):
        return w
    return pack_int4_blocks(w) if block_gemm_extension(w.packed) else pack_int4_cpu(w)


def int4_gemm(x: torch.Tensor, w: Int4Weight | Int4Cpu | Int4Blocks | Int4Cuda,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) -> [..., N] in x's dtype; w from `prepare_int4`."""
    if isinstance(w, Int4Cuda):
        if 0 < x.numel() <= TINYGEMM_ROWS * x.shape[-1]:
            return int4_tiles_gemm(x, w.tiles, bias)
        w = w.weight
    if isinstance(w, Int4Blocks):
        flat = x.dim() == 2  # a model's [T, K]: no reshape or view (a b1 step's cost)
        x2 = x if flat else x.reshape(-1, x.shape[-1])
        out = extension().q4_gemm(x2 if x2.stride(-1) == 1 else x2.contiguous(), w.qs,
                                  w.scales, w.mins, w.out_features, bias)
        return out if flat else out.view(*x.shape[:-1], w.out_features)
    if isinstance(w, Int4Cpu):
        return int4_gemm_cpu(x, w, bias)
    if use_triton(x):
        return int4_gemm_triton(x, w, bias)
    return int4_gemm_ref(x, w, bias)
