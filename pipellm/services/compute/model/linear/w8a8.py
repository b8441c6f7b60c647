"""W8A8 linear: symmetric INT8 weights with one scale per output channel (made once at load),
per-token dynamic INT8 activations, INT8 x INT8 -> INT32 GEMM with both scales applied in its
epilogue (`pipellm/kernels/int8_gemm.py`; on a CPU without VNNI, the C++ block GEMMs).

The activations come quantized from the kernel before the projection where one can fuse it
(add + RMSNorm before q/k/v and gate/up, SiLU x mul before down): the layer then receives an
`Int8Activation`. A float input (the attention output before the o projection) is quantized
here, per token.
"""

from __future__ import annotations

import torch

from pipellm.kernels.int8_gemm import int8_blocks, int8_gemm, int8_gemm_blocks
from pipellm.kernels.int8_quant import Int8Activation, quantize_int8, quantize_int8_ref


class W8A8Linear:
    """y = x @ weight^T + bias, weight [out, in] quantized at construction; x [T, in] float or
    Int8Activation -> [T, out] in the weight's original dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 amax: torch.Tensor | None = None):
        """`amax` [out]: each weight row's max |w| to scale by (None: its own)."""
        self.out_dtype, self.bias = weight.dtype, bias
        self.out_features, self.in_features = weight.shape
        q = quantize_int8_ref(weight, amax)  # per output channel: each row's max |w| -> 127
        self.blocks = int8_blocks(q.values)  # where packed, the only copy kept
        self.weight = q.values if self.blocks is None else None  # int8 [out, in]
        self.scales = q.scales  # float32 [out]

    def nbytes(self) -> int:
        if self.blocks is None:
            return self.weight.numel() + 4 * self.scales.numel()
        b = self.blocks
        return b.qs.numel() + 2 * b.scales.numel() + 4 * b.corr.numel() + 4 * self.scales.numel()

    def __call__(self, x: torch.Tensor | Int8Activation, amax: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """`amax` [T]: a float x's rows' max |x| to scale by (None: each row's own)."""
        if not isinstance(x, Int8Activation):
            x = quantize_int8(x) if amax is None else \
                quantize_int8_ref(x.reshape(-1, self.in_features), amax)
        if self.blocks is not None:
            return int8_gemm_blocks(x.values, x.scales, self.blocks, self.scales, self.bias,
                                    self.out_dtype)
        return int8_gemm(x.values, x.scales, self.weight, self.scales, self.bias, self.out_dtype)
