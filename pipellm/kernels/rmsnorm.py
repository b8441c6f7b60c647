"""RMSNorm, plain and fused with the residual add: Triton kernel, launcher, PyTorch reference.

Semantics are HF Llama's (`LlamaRMSNorm` and the decoder layer's residual add):

    h      = residual + x                                   (add_rms_norm only; in x's dtype)
    normed = weight * (h_f32 * rsqrt(mean(h_f32^2) + eps)).to(h.dtype)

The product with `weight` runs in the promoted dtype of (weight, h), as torch does it: both
factors go to float32, multiply, round once to the output dtype (a product of two fp16/bf16
values is exact in float32, so this is the same single rounding torch's CPU and CUDA kernels
make). The residual add rounds once to x's dtype the same way. 1 / sqrt is computed with
IEEE-rounded sqrt and division, as torch's CPU `rsqrt` (1 / sqrt(v)) does, and the launch sets
enable_fp_fusion=False so the GPU compiler fuses no multiply-add (x * x rounds before the sum).

The only difference from the reference is the order of the fp32 sum of squares (Triton's tree
reduction vs torch's vectorized one): the variance can differ by an ulp, which moves that row's
outputs by a few float32 ulp, and in fp16/bf16 flips the odd element by one
ulp. Everything else is bit-identical: on inputs whose sum of squares is exact in any order the
kernel matches the reference bit-for-bit (tested in fp32 and fp16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipellm.kernels.dispatch import cpu_extension, use_triton
from pipellm.kernels.int8_quant import Int8Activation, quantize_int8_ref, quantize_row


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N] input rows (last dim contiguous)
    res_ptr,  # [T, N] residual (read only when HAS_RESIDUAL)
    w_ptr,  # [N] weight
    out_ptr,  # [T, N] normed output, dtype = promote(weight, x)
    res_out_ptr,  # [T, N] residual + x, in x's dtype (written only when HAS_RESIDUAL)
    scale_ptr,  # [T] float32 per-row scales (QUANT: out_ptr is then [T, N] int8)
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    N: tl.constexpr,  # hidden size
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,  # store the normed row as int8 + one scale (W8A8 activations)
    BLOCK: tl.constexpr,  # next_power_of_2(N)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < N
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK] x dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(h.dtype)  # one rounding, as torch's add
        tl.store(res_out_ptr + row * stride_res_out + cols, h, mask=mask)
    hf = h.to(tl.float32)  # [BLOCK]
    var = tl.div_rn(tl.sum(hf * hf, axis=0), tl.full((), N, tl.float32))  # scalar mean(h^2)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = (hf * rstd).to(h.dtype).to(tl.float32)  # normalized, rounded to x's dtype
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    if QUANT:  # the normed row rounded to x's dtype, then quantized as quantize_int8_ref does
        out = (w * y).to(h.dtype).to(tl.float32)
        q, scale = quantize_row(out)
        tl.store(out_ptr + row * stride_out + cols, q, mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        out = (w * y).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """[..., hidden] -> [T, hidden] with a contiguous last dim (a view when possible)."""
    t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, quant: bool = False):
    """x, residual [..., N], weight [N] -> (normed [..., N], residual + x [..., N] or None);
    with `quant`, normed is an Int8Activation of [T, N] rows."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    block = triton.next_power_of_2(hidden)
    if block * x.element_size() > 65536:
        raise ValueError(f"hidden size {hidden} too large for a one-block-per-row RMSNorm")
    x2 = _rows(x, hidden)  # [T, N]
    res2 = _rows(residual, hidden) if residual is not None else x2  # [T, N]
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    if quant and weight.dtype != x.dtype:
        raise ValueError("the int8 RMSNorm takes a weight of x's dtype")
    out_dtype = torch.int8 if quant else torch.result_type(weight, x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    scales = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)  # [T, N]
    normed = Int8Activation(out2, scales) if quant else out
    if x2.shape[0] == 0:
        return normed, res_out
    res_out2 = res_out.view(-1, hidden) if res_out is not None else out2  # [T, N]
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out2, res_out2, scales,
        x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), eps,
        N=hidden, HAS_RESIDUAL=residual is not None, QUANT=quant, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
        enable_fp_fusion=False,  # x * x and the sum round separately, as in torch
    )
    return normed, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm: x [..., N], weight [N] -> [..., N] in promote(weight, x) dtype."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused residual add + RMSNorm; see `add_rms_norm`."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError("residual must have x's shape and dtype")
    out, res_out = _launch(x, residual, weight, eps)
    return out, res_out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch reference, exactly HF: normalize in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of `add_rms_norm`."""
    h = residual + x  # [..., N] in x's dtype, as HF's decoder layer adds
    return rms_norm_ref(h, weight, eps), h


def _cpu(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None):
    """The C++ CPU kernels (pipellm/kernels/cpu/norm.cpp) when they take this call (a CPU tensor
    under "auto", weight and residual of x's dtype, where the extension builds), else None."""
    if weight.dtype != x.dtype or (residual is not None and (
            residual.dtype != x.dtype or residual.shape != x.shape)):
        return None
    return cpu_extension(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * rmsnorm(x) [..., N] (HF semantics)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    if (ext := _cpu(x, weight)) is not None:
        return ext.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., N], weight [N] -> (rms_norm(residual + x), residual + x).

    residual + x is rounded to x's dtype (as HF adds the residual) and normalized from that
    rounded value. Both outputs are new tensors; the inputs are not modified.
    """
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    if (ext := _cpu(x, weight, residual)) is not None:
        return ext.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_int8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[Int8Activation, torch.Tensor | None]:
    """W8A8's fused norm: (quantize_int8(rms_norm(residual + x)), residual + x), or without
    a residual (quantize_int8(rms_norm(x)), None). Rows are [T, N] (x flattened)."""
    if use_triton(x):
        return _launch(x, residual, weight, eps, quant=True)
    if (ext := _cpu(x, weight, residual)) is not None:  # one pass: add, norm, quantize
        values, scales, res = ext.rms_norm_int8(x, residual, weight, eps)
        return Int8Activation(values, scales), res
    if residual is None:
        normed, res = rms_norm_ref(x, weight, eps), None
    else:
        normed, res = add_rms_norm_ref(x, residual, weight, eps)
    return quantize_int8_ref(normed.reshape(-1, x.shape[-1])), res
