"""INT4 weight-only linear (W4A16): group-wise INT4 weights (`pipellm/kernels/int4_weight.py`'s
layout: a GGUF Q4_0/Q4_1 tensor's own blocks, or our quantization of a float weight), float
activations, the weight dequantized inside the GEMM."""

from __future__ import annotations

import torch

from pipellm.kernels.int4_gemm import int4_gemm, prepare_int4
from pipellm.kernels.int4_weight import Int4Weight, quantize_int4


class Int4Linear:
    """y = x @ W^T + bias for an INT4 W [out, in]; x [T, in] -> [T, out] in x's dtype.

    `weight` is an Int4Weight (served as is) or a float tensor (quantized here, groups of
    `group_size`)."""

    def __init__(self, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None,
                 group_size: int = 32, dtype: torch.dtype = torch.float32):
        if isinstance(weight, torch.Tensor):
            dtype = weight.dtype
            weight = quantize_int4(weight, group_size)
        self.out_features, self.in_features = weight.shape
        # the layout's size with 16-bit scales and mins, however the kernel holds them
        self.weight_bytes = weight.packed.numel() + 2 * (weight.scales.numel()
                                                         + weight.mins.numel())
        self.weight = prepare_int4(weight.to(weight.packed.device, dtype))
        self.bias = bias

    def nbytes(self) -> int:
        """Bytes of the INT4 layout (packed values, fp16 scales and mins)."""
        return self.weight_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int4_gemm(x, self.weight, self.bias)
