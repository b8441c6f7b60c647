"""W8A8 and FP8 weights under tensor parallelism: where each format's scales are taken.

Both quantize each weight row with one scale (its max |w|) and each activation row (token) with
another (its max |x|), made per step. Column-parallel layers (q/k/v, gate/up) split whole rows
and read the whole (replicated) activation, so a rank quantizes its rows after the split, as one
rank would. Row-parallel layers (o, down) split the input features: a rank's slice of a weight
row, or of a token's activation, has a smaller max than the whole. `ScaledSlice` takes the
max over every rank's slice (a MAX all-reduce: of the weight rows once at load, of the tokens'
rows each step; W8A8's down gets its rows so quantized from `int8_activation`), so each rank
quantizes its slice exactly as one rank quantizes that part of the whole row; only the float
sum of the ranks' partial products (the all-reduce) differs from one rank's. Quantizing each
slice on its own scale would need no extra all-reduce, but rounds differently from one rank
(its tokens may differ). Experts split across the ranks quantize their down alike, one MAX
all-reduce per expert a step runs (every rank routes every token alike, so they run the same
experts); whole experts (--enable-expert-parallel) are quantized as on one rank. A LoRA
adapter's delta sees what it sees on one rank (o's float rows, W8A8 down's quantized ones).

SmoothQuant's factors (W8A8, over each projection's input features) are calibrated by the
rank's float model (tp/model.load_parallel): those of q/k/v and gate/up, whose input every
rank has whole, take the max over the ranks' rows; down's are the rank's own input slice's,
as one rank's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipellm.kernels import gelu_tanh_mul
from pipellm.kernels.int8_quant import Int8Activation, quantize_int8_ref
from pipellm.services.compute.model.linear import Fp8Linear, W8A8Linear

SCALED = {"w8a8": W8A8Linear, "fp8": Fp8Linear}  # the methods whose row scales span ranks


def row_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's max |x| over every rank's slice of it: x [R, K / n] -> [R] float32, whole."""
    amax = x.float().abs().amax(-1) if x.shape[0] else x.new_zeros(0, dtype=torch.float32)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


class ScaledSlice:
    """A row-parallel layer (o, down, a split expert's down) of method `name` (a key of
    SCALED) over this rank's input features `weight` [out, in / n], quantized with the whole
    rows' scales: x [T, in / n] float (its rows scaled by their whole max: a [T] MAX
    all-reduce) or an Int8Activation so quantized already -> [T, out], this rank's partial
    sum (RowParallel's, a LoraLinear's or the MoE layer's all-reduce adds the ranks')."""

    def __init__(self, name: str, weight: torch.Tensor):
        self.linear = SCALED[name](weight, None, row_max(weight))
        self.out_features, self.in_features = self.linear.out_features, self.linear.in_features

    def __call__(self, x: torch.Tensor | Int8Activation) -> torch.Tensor:
        if isinstance(x, Int8Activation):
            return self.linear(x)
        x = x.reshape(-1, self.in_features)
        return self.linear(x, row_max(x))

    def nbytes(self) -> int:
        return self.linear.nbytes()


def int8_activation(hidden_act: str):
    """W8A8's gated activation [T, 2I / n] -> Int8Activation [T, I / n], each row quantized
    with the whole row's max over the ranks, from what one rank's fused activation quantizes
    (SiLU x mul in float32: pipellm/kernels/int8_quant; GELU's product in the model's dtype)."""
    def act(gate_up: torch.Tensor) -> Int8Activation:
        if hidden_act == "silu":
            gate, up = gate_up.reshape(-1, gate_up.shape[-1]).float().chunk(2, dim=-1)
            x = F.silu(gate) * up
        else:
            x = gelu_tanh_mul(gate_up).reshape(-1, gate_up.shape[-1] // 2)
        return quantize_int8_ref(x, row_max(x))

    return act


def replicated_max(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elementwise max over the ranks (a SmoothQuant statistic of a whole input)."""
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
