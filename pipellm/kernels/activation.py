"""Gated activations of the fused gate/up projection: Triton kernels, launchers, PyTorch
references. SiLU (Llama's MLP) and GELU-tanh (Gemma's, `gelu_pytorch_tanh`).

gate_up [T, 2I] holds gate in its first half and up in its second (as `torch.chunk(2, -1)`
splits it); out [T, I] = silu(gate) * up with silu(g) = g / (1 + exp(-g)), or
gelu_tanh(gate) * up with gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3).
The kernel computes gelu_tanh(g) as g * sigmoid(2u) (the same value: 0.5 (1 + tanh(u)) =
sigmoid(2u)) with exp of -2|u| only (no overflow), where the reference's 1 + tanh(u) cancels
for very negative u: there the kernel is the more accurate. GELU-tanh has no C++ kernel: on a
CPU the reference `F.gelu(gate, approximate="tanh") * up` runs.

Rounding. The kernel computes in float32 and rounds once to the input dtype. The reference
`F.silu(gate) * up` rounds twice in fp16/bf16 (silu, then the product), so there the two differ
by at most ~1 ulp of the half type on some elements (the kernel is the more accurate). In
float32 the operations are the same; only exp's implementation differs (torch's vectorized exp
vs numpy's under the interpreter or the GPU's exp), hence differences of a few float32 ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipellm.kernels.dispatch import cpu_extension, use_triton


@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [T, 2I] gate_up rows (last dim contiguous)
    out_ptr,  # [T, I] output, contiguous
    n_inter,  # intermediate size I
    stride_x,  # row stride of gate_up (elements)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n_inter
    src = x_ptr + row * stride_x + cols
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK] gate
    u = tl.load(src + n_inter, mask=mask, other=0.0).to(tl.float32)  # [BLOCK] up
    y = g / (1.0 + tl.exp(-g)) * u  # silu(g) * up in float32
    tl.store(out_ptr + row * n_inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_mul_kernel(x_ptr, out_ptr, n_inter, stride_x, BLOCK: tl.constexpr):
    """As `_silu_mul_kernel`, with gelu_tanh(g) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715
    g^3); sigmoid(2u) = 1 / (1 + e) for u >= 0, else e / (1 + e), e = exp(-2|u|) <= 1."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < n_inter
    src = x_ptr + row * stride_x + cols
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK] gate
    up = tl.load(src + n_inter, mask=mask, other=0.0).to(tl.float32)  # [BLOCK] up
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) (g + 0.044715 g^3)
    e = tl.exp(-2.0 * tl.abs(u))
    y = g * (tl.where(u >= 0, 1.0, e) / (1.0 + e)) * up  # gelu_tanh(g) * up in float32
    tl.store(out_ptr + row * n_inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    """Run a gated-activation kernel on gate_up [..., 2I] -> [..., I]."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"last dim {two_i} of gate_up is odd")
    inter = two_i // 2
    x = gate_up.reshape(-1, two_i)  # [T, 2I]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (x.shape[0], triton.cdiv(inter, block))
    kernel[grid](x, out, inter, x.stride(0), BLOCK=block, num_warps=4)
    return out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton implementation of `silu_mul`: [..., 2I] -> [..., I]."""
    return _launch(_silu_mul_kernel, gate_up)


def gelu_tanh_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton implementation of `gelu_tanh_mul`: [..., 2I] -> [..., I]."""
    return _launch(_gelu_tanh_mul_kernel, gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """PyTorch reference, as the model's MLP computes it."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate | up) -> silu(gate) * up [..., I], in gate_up's dtype."""
    if use_triton(gate_up):
        return silu_mul_triton(gate_up)
    if (ext := cpu_extension(gate_up)) is not None:  # pipellm/kernels/cpu/activation.cpp
        return ext.silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """PyTorch reference, as transformers' Gemma MLP computes it (`gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate | up) -> gelu_tanh(gate) * up [..., I], in gate_up's dtype:
    Triton where `use_triton`, else the reference (no C++ kernel)."""
    if use_triton(gate_up):
        return gelu_tanh_mul_triton(gate_up)
    return gelu_tanh_mul_ref(gate_up)
