"""W8A8 and FP8 weights under tensor parallelism: where each format's scales are taken.

Both quantize each weight row with one scale (its max |w|) and each activation row (token) with
another (its max |x|), made per step. Column-parallel layers (q/k/v, gate/up) split whole rows
and read the whole (replicated) activation, so a rank quantizes its rows after the split, as one
rank would. Row-parallel layers (o, down) split the input features: a rank's slice of a weight
row, or of a token's activation, has a smaller max than the whole. `RowParallelScaled` takes
the max over every rank's slice (a MAX all-reduce: of the weight rows once at load, of the
tokens' rows each step), so each rank quantizes its slice exactly as one rank quantizes that
part of the whole row; only the float sum of the ranks' partial products (the all-reduce)
differs from one rank's. Quantizing each slice on its own scale would need no extra
all-reduce, but rounds differently from one rank (its tokens may differ). Experts split
across the ranks quantize their down alike, one MAX all-reduce per expert a step runs (every
rank routes every token alike, so they run the same experts); whole experts
(--enable-expert-parallel) are quantized as on one rank.

SmoothQuant's factors (W8A8, over each projection's input features) are calibrated by the
rank's float model (tp/model.load_parallel): those of q/k/v and gate/up, whose input every
rank has whole, take the max over the ranks' rows; down's are the rank's own input slice's,
as one rank's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels import gelu_tanh_mul
from services.compute.model.linear import Fp8Linear, W8A8Linear

SCALED = {"w8a8": W8A8Linear, "fp8": Fp8Linear}  # the methods whose row scales span ranks


def row_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's max |x| over every rank's slice of it: x [R, K / n] -> [R] float32, whole."""
    amax = x.float().abs().amax(-1) if x.shape[0] else x.new_zeros(0, dtype=torch.float32)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


class RowParallelScaled:
    """o or down of method `name` (a key of SCALED) over this rank's input features `weight`
    [out, in / n], quantized with the whole rows' scales: x [T, in / n] float -> [T, out],
    whole on every rank (two MAX all-reduces and the sum's per call: see the module).
    `summed` False: the output left this rank's partial sum (a split expert's down, which
    the MoE layer's one all-reduce adds)."""

    def __init__(self, name: str, weight: torch.Tensor, summed: bool = True):
        self.linear, self.summed = SCALED[name](weight, None, row_max(weight)), summed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.linear.in_features)
        out = self.linear(x, row_max(x))
        if self.summed:
            dist.all_reduce(out)
        return out

    def nbytes(self) -> int:
        return self.linear.nbytes()


def float_activation(hidden_act: str):
    """The MLP's gated activation [T, 2I] -> [T, I] in float, whose rows quantized are what
    one rank's fused W8A8 activation hands down (SiLU x mul in float32: kernels/int8_quant)."""
    if hidden_act != "silu":
        return gelu_tanh_mul

    def silu_mul_float32(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.reshape(-1, gate_up.shape[-1]).float().chunk(2, dim=-1)
        return F.silu(gate) * up

    return silu_mul_float32


def replicated_max(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elementwise max over the ranks (a SmoothQuant statistic of a whole input)."""
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
