"""Segmented LoRA (SGMV, as vLLM's punica and SGLang's kernels): every adapter group of a batch's
rows in one launch per factor. Triton kernels, launcher, PyTorch reference.

    for each group g:  y[rows[starts[g]:starts[g+1]]] += (x[those rows] @ a[slots[g]]) @ b[slots[g]]

Triton path, two launches:
    1. `_lora_shrink_kernel`, grid (splits x rank tiles, row blocks, groups): h[split, p] =
       x[rows[p]] @ a[slot] over the split's share of the `in` dimension, p a position in
       `rows`; float32 partials in a [splits, n, R] scratch (split-K for the few rows of a
       decode step, where groups x row blocks alone leave most of the GPU idle). No atomics:
       every partial is written once, the sum's order fixed (run-to-run identical results).
    2. `_lora_expand_kernel`, grid (out tiles, row blocks, groups): sums the partials, times
       b[slot], adds to y[rows[p]] in float32, stores once in y's dtype.
Row blocks past a group's size exit at once (the grid is sized by `max_rows`, a host int: no
device sync, so the launch can be captured in a CUDA graph); rows beyond a group's end are
masked; empty groups launch programs that exit.

What the kernels assume (`check_inputs` raises ValueError otherwise): R <= MAX_RANK; a [S, in, R]
and b [S, R, out] in x's dtype, R the padded rank (an adapter of a smaller rank has zero
columns of a / rows of b beyond it); float32/bf16/fp16 x and y; int64 rows, starts, slots.
On CPU tensors the values are checked too (starts from 0, nondecreasing, ending at n; groups
of at most max_rows; slots in [0, S); rows in [0, T)); on CUDA they are not (that would sync).
Rows must be distinct (never checked): a repeated row would be updated by two programs.

Accuracy. fp32 x: every product IEEE float32 ("ieee", no TF32). fp16/bf16 x: the shrink on
tensor cores (exact products, float32 sums); the expand takes the float32 h with b widened to
float32 as TF32 (h's low 13 mantissa bits dropped; fp16/bf16 b are exact in TF32). The
reference computes in float32 throughout; y rounds once in both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pipellm.kernels.dispatch import block_gemm_extension, use_triton

MAX_RANK = 256  # the largest padded rank R the kernels take
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_PROGRAMS = 264  # split the shrink's `in` until it runs about this many programs
_MAX_SPLITS = 16


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, in] activations
    a_ptr,  # [S, in, R] shrink factors, x's dtype
    h_ptr,  # [splits, n, R] float32 partial products (contiguous)
    rows_ptr, starts_ptr, slots_ptr,  # [n], [G + 1], [G] int64
    K, R, k_per_split,  # in, padded rank, `in` per split (a multiple of BLOCK_K)
    stride_hs,  # n * R: one split's partials
    stride_xm, stride_xk, stride_as, stride_ak, stride_ar,
    PRECISION: tl.constexpr,  # "ieee" for float32 x (no TF32)
    UPCAST_DOT: tl.constexpr,  # the interpreter's tl.dot cannot do bf16: fp32 operands there
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid, block, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r_tiles = tl.cdiv(R, BLOCK_R)
    split, r_tile = pid // r_tiles, pid % r_tiles
    start = tl.load(starts_ptr + g)
    size = tl.load(starts_ptr + g + 1) - start
    if block * BLOCK_M >= size:
        return  # past this group's rows: the grid is sized for the largest group
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] positions within the group
    m_ok = offs_m < size
    pos = start + offs_m  # [BM] int64 positions in rows
    row = tl.load(rows_ptr + pos, mask=m_ok, other=0)  # [BM] int64 rows of x
    slot = tl.load(slots_ptr + g)
    rr = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = rr < R
    rk = tl.arange(0, BLOCK_K)  # [BK]
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_base = x_ptr + row[:, None] * stride_xm  # [BM, 1]
    a_base = a_ptr + slot * stride_as + rr[None, :].to(tl.int64) * stride_ar  # [1, BR]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        xt = tl.load(x_base + kk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0)  # [BM, BK]
        at = tl.load(a_base + kk[:, None] * stride_ak, mask=k_ok[:, None] & r_ok[None, :],
                     other=0.0)  # [BK, BR]
        if UPCAST_DOT:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, at, input_precision=PRECISION)
    h = h_ptr + split.to(tl.int64) * stride_hs + pos[:, None] * R + rr[None, :]  # [BM, BR]
    tl.store(h, acc, mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr,  # [splits, n, R] float32 partial products (contiguous)
    b_ptr,  # [S, R, out] expand factors, x's dtype
    y_ptr,  # [T, out] output, updated in place
    rows_ptr, starts_ptr, slots_ptr,  # [n], [G + 1], [G] int64
    N, R, n_splits, stride_hs,  # out, padded rank, partials to sum, their stride (n * R)
    stride_bs, stride_br, stride_bn, stride_ym, stride_yn,
    PRECISION: tl.constexpr,  # "ieee" for float32 x, "tf32" for fp16/bf16 x
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_n, block, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(starts_ptr + g)
    size = tl.load(starts_ptr + g + 1) - start
    if block * BLOCK_M >= size:
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_ok = offs_m < size
    pos = start + offs_m  # [BM] int64 positions in rows
    row = tl.load(rows_ptr + pos, mask=m_ok, other=0)  # [BM] int64 rows of y
    slot = tl.load(slots_ptr + g)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = rn < N
    b_base = b_ptr + slot * stride_bs + rn[None, :].to(tl.int64) * stride_bn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)  # [BR]
        r_ok = rr < R
        h_mask = m_ok[:, None] & r_ok[None, :]
        h_ptrs = h_ptr + pos[:, None] * R + rr[None, :]  # [BM, BR] split 0
        h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(n_splits):
            h += tl.load(h_ptrs + s * stride_hs, mask=h_mask, other=0.0)
        bt = tl.load(b_base + rr[:, None] * stride_br, mask=r_ok[:, None] & n_ok[None, :],
                     other=0.0)  # [BR, BN]
        acc += tl.dot(h, bt.to(tl.float32), input_precision=PRECISION)
    y_ptrs = y_ptr + row[:, None] * stride_ym + rn[None, :] * stride_yn  # [BM, BN]
    mask = m_ok[:, None] & n_ok[None, :]
    out = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


class Tiling(NamedTuple):
    """One launch shape: rows a program (both kernels), `in` and rank per inner step, out
    columns per expand program, how many splits share the shrink's `in` dimension, warps a
    program. Every block a power of 2 >= 16 (tl.dot's smallest)."""

    block_m: int
    block_k: int
    block_r: int
    block_n: int
    splits: int
    num_warps: int = 4


def tiling_for(max_rows: int, d_in: int, rank: int, groups: int) -> Tiling:
    """The launch shape for groups of up to max_rows rows: 16-row blocks for decode's few rows a
    group, 64 for prefill (on 8 warps, which keeps a thread's share of the tiles' registers
    small); `in` split until the shrink runs about _TARGET_PROGRAMS programs."""
    block_m = min(max(16, triton.next_power_of_2(max_rows)), 64)
    block_r = min(max(16, triton.next_power_of_2(rank)), 64)
    block_k = min(128 if block_m <= 16 else 64, max(16, triton.next_power_of_2(d_in)))
    programs = groups * triton.cdiv(max_rows, block_m) * triton.cdiv(rank, block_r)
    splits = min(_MAX_SPLITS, _TARGET_PROGRAMS // programs, triton.cdiv(d_in, 2 * block_k))
    return Tiling(block_m, block_k, block_r, 128 if block_m <= 32 else 64, max(1, splits),
                  8 if block_m >= 64 else 4)


def check_inputs(y, x, a, b, rows, starts, slots, max_rows) -> None:
    """Raise ValueError where the arguments break `lora_delta_`'s contract. Values are checked
    on CPU tensors only (on CUDA that would sync the device)."""
    if y.dim() != 2 or x.dim() != 2 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y {tuple(y.shape)} and x {tuple(x.shape)} are not [T, out], [T, in]")
    if y.dtype not in _DTYPES or x.dtype not in _DTYPES:
        raise ValueError(f"y and x must be float32/bf16/fp16, not {y.dtype}, {x.dtype}")
    (T, d_in), d_out = x.shape, y.shape[1]
    if (a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != d_in
            or a.shape[2] != b.shape[1] or b.shape[2] != d_out):
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} are not [S, {d_in}, R] and "
                         f"[S, R, {d_out}]")
    if a.dtype != x.dtype or b.dtype != x.dtype:
        raise ValueError(f"a and b must be in x's dtype {x.dtype}, not {a.dtype}, {b.dtype}")
    if a.shape[2] > MAX_RANK:
        raise ValueError(f"rank {a.shape[2]} above the kernels' MAX_RANK {MAX_RANK}")
    for name, t in (("rows", rows), ("starts", starts), ("slots", slots)):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int64 tensor, not {t.dtype} {tuple(t.shape)}")
    if starts.shape[0] != slots.shape[0] + 1:
        raise ValueError(f"starts has {starts.shape[0]} entries for {slots.shape[0]} groups")
    if len({t.device for t in (y, x, a, b, rows, starts, slots)}) > 1:
        raise ValueError("all tensors must be on one device")
    if not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be a non-negative host int, not {max_rows!r}")
    if not y.is_cuda:
        _check_values(rows, starts, slots, max_rows, T, a.shape[0])


def _check_values(rows, starts, slots, max_rows: int, T: int, S: int) -> None:
    bounds, n = starts.tolist(), rows.shape[0]
    if bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"starts must run from 0 to n = {n}, not {bounds[0]} to {bounds[-1]}")
    sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
    if sizes and min(sizes) < 0:
        raise ValueError("starts must be nondecreasing")
    if sizes and max(sizes) > max_rows:
        raise ValueError(f"a group of {max(sizes)} rows, above max_rows {max_rows}")
    if sizes and (int(slots.min()) < 0 or int(slots.max()) >= S):
        raise ValueError(f"slots must lie in [0, {S})")
    if n and (int(rows.min()) < 0 or int(rows.max()) >= T):
        raise ValueError(f"rows must lie in [0, {T})")


def lora_delta_triton(y, x, a, b, rows, starts, slots, max_rows: int,
                      tiling: Tiling | None = None) -> None:
    """The Triton implementation of `lora_delta_` (`tiling`: a launch shape other than
    `tiling_for`'s, for tests)."""
    check_inputs(y, x, a, b, rows, starts, slots, max_rows)
    (d_in, rank), d_out, G, n = a.shape[1:], y.shape[1], slots.shape[0], rows.shape[0]
    if 0 in (G, n, max_rows, d_in, d_out, rank):
        return
    t = tiling or tiling_for(max_rows, d_in, rank, G)
    if G > 65535 or triton.cdiv(max_rows, t.block_m) > 65535:
        raise ValueError(f"{G} groups of up to {max_rows} rows exceed the launch grid")
    k_per_split = triton.cdiv(triton.cdiv(d_in, t.splits), t.block_k) * t.block_k
    splits = triton.cdiv(d_in, k_per_split)  # no split left without columns of `in`
    rows, starts, slots = rows.contiguous(), starts.contiguous(), slots.contiguous()
    h = torch.empty((splits, n, rank), dtype=torch.float32, device=y.device)
    row_blocks = triton.cdiv(max_rows, t.block_m)
    _lora_shrink_kernel[(splits * triton.cdiv(rank, t.block_r), row_blocks, G)](
        x, a, h, rows, starts, slots, d_in, rank, k_per_split, n * rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        PRECISION="ieee", UPCAST_DOT=not x.is_cuda and x.dtype == torch.bfloat16,
        BLOCK_M=t.block_m, BLOCK_K=t.block_k, BLOCK_R=t.block_r, num_warps=t.num_warps)
    _lora_expand_kernel[(triton.cdiv(d_out, t.block_n), row_blocks, G)](
        h, b, y, rows, starts, slots, d_out, rank, splits, n * rank,
        b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_R=t.block_r, num_warps=t.num_warps)


def lora_delta_reference(y, x, a, b, rows, starts, slots, max_rows: int) -> None:
    """PyTorch reference of `lora_delta_`: a loop over the groups, each a gather, two float32
    matmuls and one rounded write back. `.tolist()` of starts and slots: a sync on CUDA."""
    check_inputs(y, x, a, b, rows, starts, slots, max_rows)
    bounds = starts.tolist()
    for g, slot in enumerate(slots.tolist()):
        if bounds[g] == bounds[g + 1]:
            continue
        idx = rows[bounds[g] : bounds[g + 1]]  # [m] this group's rows
        delta = (x[idx].float() @ a[slot].float()) @ b[slot].float()  # [m, out] float32
        y[idx] = (y[idx].float() + delta).to(y.dtype)


def vnni_pack(t: torch.Tensor) -> torch.Tensor:
    """[S, K, N] -> [S, K / 2, N, 2]: rows k and k + 1 interleaved, the layout AMX's BF16 tiles
    read a GEMM's B operand in (K even)."""
    S, K, N = t.shape
    return t.view(S, K // 2, 2, N).transpose(2, 3).contiguous()


def cpu_packed(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(vnni_pack(a), vnni_pack(b)) where the CPU kernel would run them on AMX tiles (bf16
    stacks on a CPU at the `amx` level, the C++ kernels in use); else None."""
    from pipellm.kernels.cpu import isa

    if a.dtype != torch.bfloat16 or a.device.type != "cpu" or a.shape[1] % 32 \
            or block_gemm_extension(a) is None or isa.selected() != "amx":
        return None
    return vnni_pack(a), vnni_pack(b)


def lora_delta_(y, x, a, b, rows, starts, slots, max_rows: int,
                part_ends: list[int] | None = None,
                packed: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """In place, for each group g (0 <= g < G):
         y[rows[starts[g]:starts[g+1]]] += (x[those rows] @ a[slots[g]]) @ b[slots[g]]
    y [T, out] (float32/bf16/fp16), x [T, in] (float32/bf16/fp16, may differ from y's dtype),
    a [S, in, R] and b [S, R, out] in x's dtype (R the padded rank: an adapter of a smaller rank
    has zero columns/rows beyond it), rows [n] int64 (distinct row indices of y/x, grouped:
    group g is rows[starts[g]:starts[g+1]]), starts [G+1] int64 (starts[0] = 0, nondecreasing,
    starts[G] = n), slots [G] int64 in [0, S), max_rows = max group size (a host int, so that a
    launch needs no device sync). The product is accumulated in float32 and added to y once
    (y's rows outside `rows` untouched). `part_ends`: where b is block-diagonal, the ends of
    its P column blocks (out = part_ends[-1]; part j's rows of b j R/P .. (j + 1) R/P, zeros
    elsewhere, which the CPU kernel does not read). Triton where `use_triton(y)`; on a CPU
    the C++ kernel (pipellm/kernels/cpu/lora.cpp: an AVX2 or AVX-512 level, R and out multiples of
    16, contiguous rows; `packed`, cpu_packed's copies of a and b: AMX tiles); else the
    reference."""
    if use_triton(y):
        lora_delta_triton(y, x, a, b, rows, starts, slots, max_rows)
    elif (ext := block_gemm_extension(y)) is not None and _cpu_kernel_takes(y, x, a, b):
        ext.lora_delta(y, x, a, b, rows, starts, slots, part_ends or [y.shape[1]],
                       *(packed or ()))
    else:
        lora_delta_reference(y, x, a, b, rows, starts, slots, max_rows)


def _cpu_kernel_takes(y, x, a, b) -> bool:
    """Whether pipellm/kernels/cpu/lora.cpp's vectorized variants take these operands."""
    return (a.shape[2] % 16 == 0 and y.shape[1] % 16 == 0 and y.stride(1) == 1
            and x.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
            and x.dtype == a.dtype == b.dtype and x.dtype in _DTYPES and y.dtype in _DTYPES)
