"""Q8 block linear: INT8 weights with a scale per block of 32 (a GGUF's Q8_0 rule), activations
quantized to INT8 per row and block on the fly (`pipellm/kernels/q8_gemm.py`). Serves the LM head of
a 4-bit GGUF model on an x86 CPU with AVX2 or better, as llama.cpp does with the same file (its tied
embedding is Q8_0, and re-quantizing its float copy gives the file's blocks back)."""

from __future__ import annotations

import torch

from pipellm.kernels.q8_gemm import Q8Weight, prepare_q8, q8_gemm, quantize_q8


class Q8Linear:
    """y = x @ weight^T + bias, weight [out, in] a Q8Weight (served as is) or a float tensor
    (quantized at construction); x [T, in] -> [T, out] in x's dtype."""

    def __init__(self, weight: torch.Tensor | Q8Weight, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        q = weight if isinstance(weight, Q8Weight) else quantize_q8(weight)
        self.weight_bytes = q.values.numel() + 2 * q.scales.numel()
        self.weight, self.bias = prepare_q8(q), bias

    def nbytes(self) -> int:
        """Bytes of the Q8 layout (values and fp16 scales)."""
        return self.weight_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return q8_gemm(x, self.weight, self.bias)
