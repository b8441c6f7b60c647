"""A quantized layer on an AMX CPU: the block GEMM for a step with few rows, a bf16 copy of its
weight in oneDNN (which runs AMX tiles) for a step with many.

The block GEMMs (INT4 / Q8 weights, INT8 activations, kernels/cpu/block_gemm.cpp) read a quarter
to a half of bf16's bytes, which wins while a step is bound by memory; AMX's tiles do 16x the
multiply-adds of VNNI per instruction, which wins once a step has enough rows to be bound by
compute (a prefill, a large batch). Where the two cross over is measured by bench/cpu_gemm.py
(docs/benchmarks.md); a layer takes `min_rows` from the caller. The bf16 copy is the quantized
weight dequantized (the values the block GEMM multiplies, rounded to bf16), so both paths serve
the same model; the price is its memory, 2 bytes a weight beside the blocks.
"""

from __future__ import annotations

import torch

from kernels.cpu import isa
from kernels.dispatch import cpu_fast_path
from services.compute.model.linear.dense import Linear

PROJECTION_MIN_ROWS = 48  # rows from which SmolLM2's projections run faster as bf16 on AMX
HEAD_MIN_ROWS = 16  # the same for its LM head (49,152 x 576)


def available(device: torch.device) -> bool:
    """Whether layers on `device` get a bf16 copy: a CPU at the `amx` level (kernels/cpu/isa.py),
    the CPU kernels in use (`--kernels auto`)."""
    return device.type == "cpu" and cpu_fast_path(torch.empty(0)) and isa.selected() == "amx"


class AmxRows:
    """y = x @ W^T + bias by `small` (a block-GEMM layer) below `min_rows` rows of x, else by a
    oneDNN bf16 GEMM on `dense_weight` (W dequantized, [out, in]); x [..., in] -> [..., out] in
    x's dtype either way."""

    def __init__(self, small, dense_weight: torch.Tensor, bias: torch.Tensor | None,
                 min_rows: int):
        self.small, self.min_rows = small, min_rows
        self.out_features, self.in_features = dense_weight.shape
        self.large = Linear(dense_weight.to(torch.bfloat16),
                            None if bias is None else bias.to(torch.bfloat16))

    def nbytes(self) -> int:
        """Bytes of both copies."""
        return self.small.nbytes() + self.large.nbytes()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return self.small(x)
        return self.large(x.to(torch.bfloat16)).to(x.dtype)
