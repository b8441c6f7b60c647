"""W8A8 GEMM: INT8 activations x INT8 weights accumulated in INT32, both scales applied in the
epilogue. Triton kernel, launcher, PyTorch reference, and the CPU paths: `torch._int_mm`
(oneDNN, fast with VNNI) and, on a CPU without VNNI, the C++ block GEMMs' 8-bit path (every
block's scale 1, the per-row scales applied after: `int8_blocks`).

    out[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n] (+ bias[n])

xq [M, K] int8 with one scale per row (per token, made at run time by the fused RMSNorm or
SiLU x mul kernels: `pipellm/kernels/int8_quant.py`); wq [N, K] int8 with one scale per output
channel (made once at load). The INT32 sum is exact; the epilogue computes in float32 and rounds
once to the output dtype, so the kernel and the reference differ only by float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipellm.kernels.cpu import extension, isa
from pipellm.kernels.dispatch import block_gemm_extension, cpu_fast_path, use_triton
from pipellm.kernels.q8_gemm import BLOCK, Q8Blocks, Q8Weight, pack_q8_blocks


@triton.jit
def _int8_gemm_kernel(
    x_ptr,  # [M, K] int8, row stride stride_x
    w_ptr,  # [N, K] int8, contiguous
    xs_ptr,  # [M] float32 per-token scales
    ws_ptr,  # [N] float32 per-channel scales
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N], contiguous
    M, N, K, stride_x,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0)  # [BM, BK]
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0)  # [BN, BK]
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.int32)
    xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)  # [BM]
    ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)  # [BN]
    out = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(xq, x_scale, wq, w_scale) -> None:
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise ValueError("int8_gemm takes int8 activations and weights")
    if xq.shape[1] != wq.shape[1]:
        raise ValueError(f"K mismatch: activations {tuple(xq.shape)}, weight {tuple(wq.shape)}")
    if x_scale.shape != (xq.shape[0],) or w_scale.shape != (wq.shape[0],):
        raise ValueError("x_scale must be [M] and w_scale [N]")


def int8_gemm_triton(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16):
    """Triton implementation of `int8_gemm`."""
    _check(xq, x_scale, wq, w_scale)
    (M, K), N = xq.shape, wq.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    if xq.stride(1) != 1:
        xq = xq.contiguous()
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    _int8_gemm_kernel[grid](
        xq, wq.contiguous(), x_scale.float().contiguous(), w_scale.float().contiguous(),
        bias if bias is not None else out, out, M, N, K, xq.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4)
    return out


def _epilogue(acc, x_scale, w_scale, bias, out_dtype):
    """acc [M, N] (exact integer sums) -> scaled [M, N] in out_dtype (float32 arithmetic)."""
    out = acc.float() * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def int8_gemm_ref(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16):
    """PyTorch reference: the integer sums in float64 (exact), then the epilogue."""
    _check(xq, x_scale, wq, w_scale)
    return _epilogue(xq.double() @ wq.double().t(), x_scale, w_scale, bias, out_dtype)


def int8_gemm_cpu(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16):
    """CPU: torch._int_mm (oneDNN, INT32 accumulation) and the same epilogue."""
    _check(xq, x_scale, wq, w_scale)
    if xq.shape[0] == 0:
        return torch.empty(0, wq.shape[0], dtype=out_dtype)
    return _epilogue(torch._int_mm(xq, wq.t()), x_scale, w_scale, bias, out_dtype)


def int8_blocks(wq: torch.Tensor) -> Q8Blocks | None:
    """wq int8 [N, K] packed for the block GEMMs (each block's fp16 scale 1: the float32
    per-row scales apply after), where those run, K is whole blocks and the CPU has no VNNI
    (`torch._int_mm` is slow there); else None."""
    if wq.shape[1] % BLOCK or block_gemm_extension(wq) is None or isa.int8_dot_products():
        return None
    ones = torch.ones(wq.shape[0], wq.shape[1] // BLOCK, dtype=torch.float16)
    return pack_q8_blocks(Q8Weight(wq, ones))


def int8_gemm_blocks(xq: torch.Tensor, x_scale: torch.Tensor, w: Q8Blocks,
                     w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`int8_gemm` with wq from `int8_blocks` (C++: pipellm/kernels/cpu/block_gemm.cpp)."""
    acc = extension().q8_gemm_int8_rows(xq.contiguous(), x_scale, w.qs, w.scales, w.corr,
                                        w.out_features)
    acc.mul_(w_scale.float()[None, :])  # x_scale[m] * the INT32 sum came from the kernel
    if bias is not None:
        acc += bias.float()
    return acc.to(out_dtype)


def int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """xq [M, K] int8, x_scale [M], wq [N, K] int8, w_scale [N], bias [N] or None ->
    [M, N] out_dtype = (xq @ wq^T) * x_scale[:, None] * w_scale[None, :] + bias."""
    if use_triton(xq):
        return int8_gemm_triton(xq, x_scale, wq, w_scale, bias, out_dtype)
    if cpu_fast_path(xq):
        return int8_gemm_cpu(xq, x_scale, wq, w_scale, bias, out_dtype)
    return int8_gemm_ref(xq, x_scale, wq, w_scale, bias, out_dtype)
