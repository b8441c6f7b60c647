"""A quantized layer on an AMX CPU: the block GEMM for a step with few rows (it reads a quarter
to a half of bf16's bytes), a bf16 copy of its weight in oneDNN, which runs AMX tiles, for a step
with many (bound by compute: a prefill, a large batch). The copy is the quantized weight
dequantized, so both paths serve the same model; it costs 2 bytes a weight. Where the two cross
over: bench/cpu_gemm.py, docs/benchmarks.md.
"""

from __future__ import annotations

import torch

from pipellm.kernels.cpu import isa
from pipellm.kernels.dispatch import cpu_fast_path
from pipellm.services.compute.model.linear.dense import Linear

PROJECTION_MIN_ROWS = 48  # rows from which SmolLM2's projections run faster as bf16 on AMX
HEAD_MIN_ROWS = 16  # the same for its LM head (49,152 x 576)


def available(device: torch.device) -> bool:
    """Whether layers on `device` get a bf16 copy: a CPU at the `amx` level
    (pipellm/kernels/cpu/isa.py), the CPU kernels in use (`--kernels auto`)."""
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
