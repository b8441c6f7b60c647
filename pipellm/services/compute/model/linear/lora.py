"""A projection with LoRA adapters beside it: the base layer (dense, INT4, FP8, W8A8, ... as the
quantization method built it, untouched) computes every row; each adapter present in the step
adds its delta to its own rows only: long runs of one adapter (a prefill chunk) by GEMMs on
their slice, the other groups all in one kernel call (pipellm/kernels/lora.py)."""

from __future__ import annotations

import torch

from pipellm.kernels.int8_quant import Int8Activation
from pipellm.kernels.lora import cpu_packed, lora_delta_
from pipellm.services.compute.core.lora_groups import LoraGroups

RANK_MULTIPLE = 16  # stacks' rank padded to a multiple of this (the CPU kernel's vectors)


class LoraLinear:
    """y = base(x), then for each group of rows of the adapter in slot s:
    y[rows] += (x[rows] @ a[s]) @ b[s].

    a [S, in, P Rp] and b [S, P Rp, out] stack every served adapter's fused factors
    (`weights.fuse`: scaling folded into b) in the activation dtype, slot s the adapter's index
    in the model's `lora_slots`. The output's P parts (`part_sizes`: q, k, v of a fused qkv)
    each have Rp columns of a and rows of b (the largest rank, a multiple of RANK_MULTIPLE):
    b is zero outside each part's block, which the CPU kernel skips. An adapter of a smaller
    rank, or not targeting a part, has zeros there; one targeting none of this projection is
    not in `targeted`. Called as the base layer is, `layer(x)`, or with the step's groups,
    `layer(x, lora)`. `reduce`: applied in place to y, base and deltas (a tensor-parallel
    row-parallel layer's all-reduce of its partial sums: pipellm/services/compute/tp/)."""

    def __init__(self, base, part_sizes: tuple[int, ...] = (), reduce=None):
        self.base, self.reduce = base, reduce or (lambda y: None)
        self.out_features, self.in_features = base.out_features, base.in_features
        sizes = part_sizes or (self.out_features,)
        if sum(sizes) != self.out_features:
            raise ValueError(f"parts {sizes} do not add up to {self.out_features} outputs")
        self.part_ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        self.a: torch.Tensor | None = None  # None until an adapter is added
        self.b: torch.Tensor | None = None
        self.targeted: set[int] = set()  # slots whose adapter targets this projection
        self.packed = None  # the stacks as the CPU kernel's AMX tiles read them, where it does

    def append(self, factors: tuple[torch.Tensor, torch.Tensor] | None, like: torch.Tensor,
               ) -> None:
        """Give the next slot (S) an adapter's factors a [in, P r], b [P r, out] (part j's in
        columns / rows j r .. (j + 1) r), or zeros (None: it does not target this projection);
        `like` gives the dtype and device."""
        P, S = len(self.part_ends), 0 if self.a is None else self.a.shape[0]
        if factors is not None and (factors[0].shape[0] != self.in_features
                                    or factors[1].shape[1] != self.out_features
                                    or factors[0].shape[1] % P):
            raise ValueError(f"LoRA factors {tuple(factors[0].shape)} x "
                             f"{tuple(factors[1].shape)} do not fit a [{self.out_features}, "
                             f"{self.in_features}] projection of {P} parts")
        r = 0 if factors is None else factors[0].shape[1] // P
        old = 0 if self.a is None else self.a.shape[2] // P
        rp = max(old, -(-r // RANK_MULTIPLE) * RANK_MULTIPLE)
        a = like.new_zeros(S + 1, self.in_features, P * rp)
        b = like.new_zeros(S + 1, P * rp, self.out_features)
        for j in range(P):  # part j: columns of a, rows of b j rp .. j rp + its rank
            if self.a is not None:
                a[:S, :, j * rp : j * rp + old] = self.a[:, :, j * old : (j + 1) * old]
                b[:S, j * rp : j * rp + old] = self.b[:, j * old : (j + 1) * old]
            if factors is not None:
                a[S, :, j * rp : j * rp + r] = factors[0][:, j * r : (j + 1) * r]
                b[S, j * rp : j * rp + r] = factors[1][j * r : (j + 1) * r]
        if factors is not None:
            self.targeted.add(S)
        self.a, self.b, self.packed = a, b, cpu_packed(a, b)

    def drop(self, slot: int) -> None:
        """Remove slot `slot`; the slots after it move down by one."""
        keep = [s for s in range(self.a.shape[0]) if s != slot]
        self.a, self.b = self.a[keep].contiguous(), self.b[keep].contiguous()
        self.packed = cpu_packed(self.a, self.b)
        self.targeted = {s - (s > slot) for s in self.targeted if s != slot}

    def nbytes(self) -> int:
        """The base layer's bytes and the stacks'."""
        stacks = 0 if self.a is None else sum(t.numel() * t.element_size()
                                               for t in (self.a, self.b, *(self.packed or ())))
        return self.base.nbytes() + stacks

    def __call__(self, x: torch.Tensor, lora: LoraGroups | None = None) -> torch.Tensor:
        y = self.base(x)
        if lora is None or lora.active.isdisjoint(self.targeted):
            self.reduce(y)
            return y
        if isinstance(x, Int8Activation):  # a W8A8 base's input: the delta runs in float
            x = x.dequantize()
        x = x if x.dtype == self.a.dtype else x.to(self.a.dtype)
        for slot, lo, hi in lora.dense:  # long runs: two GEMMs on their slice
            if slot in self.targeted:
                h = (x[lo:hi] @ self.a[slot]).to(y.dtype)
                y[lo:hi].addmm_(h, self.b[slot].to(y.dtype))
        if lora.rows is not None:
            lora_delta_(y, x, self.a, self.b, lora.rows, lora.starts, lora.slots,
                        lora.max_rows, self.part_ends, self.packed)
        self.reduce(y)
        return y
