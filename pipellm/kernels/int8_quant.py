"""Per-token dynamic INT8 activations for W8A8: Triton kernel, launchers, PyTorch reference.
The same kernel makes FP8 (e4m3) rows for the FP8 linear (`quantize_fp8_rows`: scale = max |x|
/ 448, at least 1e-12; values x / scale, saturated, rounded to nearest even), as
pipellm/services/compute/model/linear/fp8.py's reference does.

Each row (token) gets one float32 scale = max |x| / 127 and values round(x / scale) in
[-127, 127], rounded half away from zero (as the INT8 KV cache's). A row of zeros has scale 0
and values 0. Two producers: the plain quantization of a row (the attention output, before the
o projection) and SiLU x mul fused with it (before the down projection); the third, RMSNorm
fused with it, lives with the norm (`rmsnorm.rms_norm_int8`) and shares `quantize_row`.

The fused SiLU x mul quantizes its float32 result directly (the unfused path would first round
it to the activation dtype). Kernel and reference then differ only where exp's implementations
round differently and a value sits at a rounding tie: at most one step on rare elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipellm.kernels.dispatch import cpu_extension, use_triton


@dataclass
class Int8Activation:
    """Quantized rows: values int8 [T, K], scales float32 [T]; row t = values[t] * scales[t]."""

    values: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


@triton.jit
def quantize_row(x):
    """x float32 [BLOCK] (masked lanes 0) -> (int8 values [BLOCK], float32 scale)."""
    scale = tl.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.where(scale > 0, tl.div_rn(x, safe), 0.0)
    q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(-q + 0.5))  # round half away from 0
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def _round_e4m3(q):
    """float32 q (|q| <= 448) rounded to nearest even on e4m3's grid (3 mantissa bits; steps of
    2^-9 below 2^-6), as a float32 that converts to e4m3 exactly. The conversion alone rounds
    the same on a GPU, but the interpreter's drops the carry into the exponent (31 -> 16)."""
    e = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # unbiased exponent
    step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    return ((tl.div_rn(q, step) + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: half even


@triton.jit
def _load_act(x_row, cols, mask, n, SILU_MUL: tl.constexpr):
    """float32 [BLOCK] of the row's activation: x, or silu(gate) * up with up at +n."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        u = tl.load(x_row + n + cols, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * u
    return x


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [T, K] rows, or [T, 2K] gate | up when SILU_MUL (last dim contiguous)
    q_ptr,  # [T, K] int8 out, contiguous
    s_ptr,  # [T] float32 scales out
    n,  # K, the quantized row's length
    stride_x,
    SILU_MUL: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr = False,  # e4m3 values (q_ptr float8e4nv), the FP8 linear's scales
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros((), dtype=tl.float32)
    for c0 in range(0, n, BLOCK):  # pass 1: the row's max |x|
        cols = c0 + tl.arange(0, BLOCK)
        x = _load_act(x_row, cols, cols < n, n, SILU_MUL)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    if FP8:
        scale = tl.maximum(tl.div_rn(amax, 448.0), 1e-12)
    else:
        scale = tl.div_rn(amax, 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    for c0 in range(0, n, BLOCK):  # pass 2: quantize against it (recomputing the activation)
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < n
        q = tl.where(scale > 0, tl.div_rn(_load_act(x_row, cols, mask, n, SILU_MUL), safe), 0.0)
        if FP8:
            q = _round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))
            q = q.to(q_ptr.dtype.element_ty)
        else:
            q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(-q + 0.5))
            q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
        tl.store(q_ptr + row * n + cols, q, mask=mask)
    tl.store(s_ptr + row, scale)


def _launch(x: torch.Tensor, n: int, silu_mul: bool,
            dtype: torch.dtype = torch.int8) -> Int8Activation:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = Int8Activation(torch.empty(rows.shape[0], n, dtype=dtype, device=x.device),
                         torch.empty(rows.shape[0], dtype=torch.float32, device=x.device))
    if rows.shape[0]:
        _quant_rows_kernel[(rows.shape[0],)](rows, out.values, out.scales, n, rows.stride(0),
                                             SILU_MUL=silu_mul, num_warps=4,
                                             BLOCK=min(triton.next_power_of_2(n), 1024),
                                             FP8=dtype != torch.int8, enable_fp_fusion=False)
    return out


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]) in one Triton launch: the FP8 linear's
    per-token activations (its `quantize_fp8` is the reference)."""
    out = _launch(x, x.shape[-1], silu_mul=False, dtype=torch.float8_e4m3fn)
    return out.values, out.scales[:, None]


def quantize_int8_ref(x: torch.Tensor, amax: torch.Tensor | None = None) -> Int8Activation:
    """PyTorch reference: x [T, K] -> Int8Activation (per-row scales, float32 arithmetic);
    `amax` [T]: each row's max |x| to scale by (None: its own; a larger one, a tensor-parallel
    row's whole max over its ranks' slices)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) if amax is None else amax.float()) / 127.0  # [T]
    s = torch.where(scale > 0, scale, 1.0)[:, None]
    q = torch.where(scale[:, None] > 0, xf / s, 0.0)
    q = q.sign() * (q.abs() + 0.5).floor()  # round half away from zero
    return Int8Activation(q.clamp_(-127, 127).to(torch.int8), scale)


def silu_mul_int8_ref(gate_up: torch.Tensor) -> Int8Activation:
    """PyTorch reference of `silu_mul_int8`: SiLU x mul in float32, then quantize_int8_ref."""
    gate, up = gate_up.reshape(-1, gate_up.shape[-1]).float().chunk(2, dim=-1)
    return quantize_int8_ref(F.silu(gate) * up)


def quantize_int8(x: torch.Tensor) -> Int8Activation:
    """x [..., K] -> per-token INT8 rows [T, K] (T = x.numel() // K)."""
    if use_triton(x):
        return _launch(x, x.shape[-1], silu_mul=False)
    if (ext := cpu_extension(x)) is not None:  # pipellm/kernels/cpu/int8_quant.cpp
        return Int8Activation(*ext.quantize_int8(x))
    return quantize_int8_ref(x.reshape(-1, x.shape[-1]))


def silu_mul_int8(gate_up: torch.Tensor) -> Int8Activation:
    """gate_up [..., 2I] (gate | up) -> quantize_int8(silu(gate) * up) as [T, I] rows."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"last dim {gate_up.shape[-1]} of gate_up is odd")
    if use_triton(gate_up):
        return _launch(gate_up, gate_up.shape[-1] // 2, silu_mul=True)
    if (ext := cpu_extension(gate_up)) is not None:  # pipellm/kernels/cpu/int8_quant.cpp
        return Int8Activation(*ext.silu_mul_int8(gate_up))
    return silu_mul_int8_ref(gate_up)
