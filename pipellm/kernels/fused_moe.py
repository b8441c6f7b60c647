"""Fused mixture-of-experts MLP (vLLM's / SGLang's fused_moe design): Triton kernel, launcher,
PyTorch reference.

    out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, j]

x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I]; the
router's choice ids [T, k] (int64) with weights w [T, k] (float32).

Steps. Each (token, slot) pair p = t * k + j is one row of the work. `moe_align_block_size`
sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M with the
sentinel T * k, so that every block of BLOCK_M sorted rows belongs to one expert (its entry in
`expert_ids`). One launch of `_fused_moe_kernel` then runs every expert's gate_up GEMM (a
block gathers its rows of x, multiplies by its expert's weight), SiLU x mul runs on the [T * k,
2I] result, a second launch runs the down GEMMs with the routing weights applied in its
epilogue, and the k rows of each token are summed. The alignment is torch ops without a host
sync (no `.item()`, no data-dependent shapes): the grid is sized for the worst case
(T * k + E * (BLOCK_M - 1) rows) and blocks past the used length exit at once, so the step
can be captured in a CUDA graph.

Accuracy. float32 operands multiply as IEEE float32 ("ieee": no TF32); half types on tensor
cores, accumulated in float32. The reference adds a token's k contributions in expert order,
the kernel in slot order: equal for k = 2, a few ulp apart beyond.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipellm.kernels.activation import silu_mul
from pipellm.kernels.dispatch import use_triton


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [M, K] activations; sorted pair p reads row p // TOP_K (row stride stride_am)
    b_ptr,  # [E, N, K] expert weights (K contiguous)
    c_ptr,  # [num_pairs, N] output, row p for pair p (row stride stride_cm)
    w_ptr,  # [num_pairs] float32 routing weights (read when MUL_WEIGHT)
    sorted_ptr,  # [padded] int64 pair ids grouped by expert; num_pairs marks padding
    expert_ptr,  # [padded / BLOCK_M] int64 expert of each block of sorted rows
    used_ptr,  # [1] int64 sorted rows in use (each expert's run padded to BLOCK_M)
    N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # the interpreter's tl.dot cannot do bf16: fp32 operands there
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return  # past the last expert's run: the grid is sized for the worst case
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    ok = pair < num_pairs
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = (pair // TOP_K).to(tl.int64)  # [BM] rows of a
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)  # [BK]
    b_base = b_ptr + expert * stride_be + rn[None, :].to(tl.int64) * stride_bn  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + rk)[None, :],
                    mask=ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(b_base + (k0 + rk)[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [BK, BN]
        if UPCAST_DOT:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(w_ptr + pair, mask=ok, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None].to(tl.int64) * stride_cm + rn[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


def moe_align_block_size(ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_ids [P] int64, expert_ids [P / block_m] int64, used [1] int64).

    sorted_ids lists the pairs p = t * k + j grouped by expert (ascending; within an expert
    ascending p), each expert's run padded with T * k to a multiple of block_m; expert_ids[b]
    is the expert of rows [b * block_m, (b + 1) * block_m); `used` counts the rows in use.
    P = ceil((T * k + E * (block_m - 1)) / block_m) * block_m, a bound known without a sync."""
    flat = ids.reshape(-1)  # [n] the expert of each pair
    n, dev = flat.numel(), ids.device
    padded_len = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] pairs per expert
    runs = (counts + block_m - 1) // block_m * block_m  # [E] padded run lengths
    ends = runs.cumsum(0)  # [E] end of each expert's run in sorted_ids
    order = torch.argsort(flat, stable=True)  # [n] pair ids grouped by expert
    experts = flat[order]  # [n] non-decreasing
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[experts]  # within its run
    sorted_ids = torch.full((padded_len,), n, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, (ends - runs)[experts] + rank, order)
    block_starts = torch.arange(0, padded_len, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids, ends[-1:]


def _grouped_gemm(a, b, out, align, top_k: int, weights: torch.Tensor | None,
                  block_m: int) -> None:
    """out[p] = a[p // top_k] @ b[expert(p)]^T (x weights[p]) for every pair p in `align`."""
    sorted_ids, expert_ids, used = align
    N, K = b.shape[1], b.shape[2]
    block_n, block_k = 64, 32
    grid = (sorted_ids.numel() // block_m, triton.cdiv(N, block_n))
    _fused_moe_kernel[grid](
        a, b, out, out if weights is None else weights, sorted_ids, expert_ids, used,
        N, K, out.shape[0], a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        TOP_K=top_k, MUL_WEIGHT=weights is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST_DOT=not a.is_cuda and a.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Triton implementation of `fused_moe`: x [T, H] -> [T, H] in x's dtype."""
    T, k = ids.shape
    E, two_i, H = w13.shape
    if w2.shape != (E, H, two_i // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
    if T == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    block_m = 16 if T * k <= 16 * E else 64  # decode steps: little padding per expert
    align = moe_align_block_size(ids, E, block_m)
    gate_up = torch.empty(T * k, two_i, dtype=x.dtype, device=x.device)  # row p = pair p
    _grouped_gemm(x, w13, gate_up, align, k, None, block_m)
    act = silu_mul(gate_up)  # [T * k, I]
    down = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, align, 1, weights.reshape(-1).float().contiguous(), block_m)
    return down.view(T, k, H).sum(1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """PyTorch reference, transformers' expert loop: for each expert, its tokens' SwiGLU
    output times their routing weight, added into the result in ascending expert order."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)  # [n] each
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum for each token: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    weights [T, k] float32, ids [T, k] int64 -> [T, H] in x's dtype."""
    if use_triton(x):
        return fused_moe_triton(x, w13, w2, weights, ids)
    return fused_moe_ref(x, w13, w2, weights, ids)
