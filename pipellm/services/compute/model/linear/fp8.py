"""FP8 linear (W8A8 in float8 e4m3): weights with one scale per output channel (made at load),
per-token dynamic activation scales (one Triton launch on GPUs), `torch._scaled_mm` with
row-wise scales (cuBLASLt's FP8 GEMM on GPUs with FP8 tensor cores, compute capability 8.9+;
PyTorch's own kernel on CPU, a correct but unaccelerated path). Other GPUs are refused at
start-up (`quantization.py`)."""

from __future__ import annotations

import torch

from pipellm.kernels.dispatch import use_triton
from pipellm.kernels.int8_quant import quantize_fp8_rows

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_fp8(x: torch.Tensor, amax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 scales [R, 1]) with each row's max |x| -> 448;
    `amax` [R]: the max to scale each row by (None: its own)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True) if amax is None else amax.float()[:, None]
    scale = (amax / E4M3_MAX).clamp(min=1e-12)
    return (xf / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_gemm_ref(xq, x_scale, wq, w_scale, bias, out_dtype) -> torch.Tensor:
    """PyTorch reference: dequantize both operands, multiply in float32."""
    out = (xq.float() * x_scale) @ (wq.float() * w_scale).t()
    return (out if bias is None else out + bias.float()).to(out_dtype)


class Fp8Linear:
    """y = x @ weight^T + bias with e4m3 operands; x [T, in] -> [T, out] in the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 amax: torch.Tensor | None = None):
        """`amax` [out]: each weight row's max |w| to scale by (None: its own)."""
        self.out_dtype, self.bias = weight.dtype, bias
        self.out_features, self.in_features = weight.shape
        wq, scale = quantize_fp8(weight, amax)
        self.weight_t, self.scales = wq.t(), scale.t().contiguous()  # [in, out], [1, out]

    def nbytes(self) -> int:
        return self.weight_t.numel() + 4 * self.scales.numel()

    def __call__(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
        """`amax` [T]: each row's max |x| to scale by (None: its own)."""
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features, dtype=self.out_dtype)
        if amax is None and use_triton(x2):  # one launch instead of a chain of ops
            xq, x_scale = quantize_fp8_rows(x2)
        else:
            xq, x_scale = quantize_fp8(x2, amax)
        out = torch._scaled_mm(xq, self.weight_t, scale_a=x_scale, scale_b=self.scales,
                               bias=self.bias, out_dtype=self.out_dtype)
        return out.view(*x.shape[:-1], self.out_features)
