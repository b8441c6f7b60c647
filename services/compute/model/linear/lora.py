"""A projection with LoRA adapters beside it: the base layer (dense, INT4, FP8, ... as the
quantization method built it, untouched) computes every row; each adapter present in the step
adds its delta to its own rows only."""

from __future__ import annotations

import torch

from services.compute.core.lora_groups import LoraGroups


class LoraLinear:
    """y = base(x), then for each group of rows of adapter n: y[rows] += (x[rows] @ A_n) @ B_n.

    A_n [in, R] and B_n [R, out] are the adapter's fused factors in the activation dtype, its
    scaling folded into B_n (`weights.fuse`). A projection an adapter does not target has no
    entry for it: its rows get the base output. Called as the base layer is, `layer(x)`, or
    with the step's groups, `layer(x, lora)`: the adapter rows are gathered once, each group's
    delta written into one buffer, added back once (CPU steps are bound by the ops' count)."""

    def __init__(self, base):
        self.base = base
        self.out_features, self.in_features = base.out_features, base.in_features
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Serve adapter `name` on this projection: a [in, R], b [R, out]."""
        if a.shape[0] != self.in_features or b.shape[1] != self.out_features:
            raise ValueError(f"LoRA {name}: factors {tuple(a.shape)} x {tuple(b.shape)} do "
                             f"not fit a [{self.out_features}, {self.in_features}] projection")
        self.adapters[name] = (a, b)

    def nbytes(self) -> int:
        """The base layer's bytes and every adapter's."""
        return self.base.nbytes() + sum(t.numel() * t.element_size()
                                         for ab in self.adapters.values() for t in ab)

    def __call__(self, x: torch.Tensor, lora: LoraGroups | None = None) -> torch.Tensor:
        y = self.base(x)
        if lora is None:
            return y
        served = [(self.adapters.get(name), lo, hi) for name, lo, hi in lora.groups]
        if all(ab is None for ab, _, _ in served):
            return y
        xs = x[lora.span[0] : lora.span[1]] if lora.span else x.index_select(0, lora.rows)
        delta = y.new_empty(xs.shape[0], self.out_features)  # [n adapter rows, out]
        for ab, lo, hi in served:
            if ab is None:
                delta[lo:hi].zero_()
            elif ab[1].dtype == delta.dtype:
                a, b = ab
                torch.mm(xs[lo:hi].to(a.dtype) @ a, b, out=delta[lo:hi])
            else:  # a base layer answering in another dtype than the activations'
                a, b = ab
                delta[lo:hi] = (xs[lo:hi].to(a.dtype) @ a) @ b
        if lora.span:
            y[lora.span[0] : lora.span[1]] += delta
        elif lora.inverse is not None:  # every row an adapter row: a gather (faster on CPU)
            y += delta.index_select(0, lora.inverse)
        else:
            y.index_add_(0, lora.rows, delta)
        return y
