"""Serving LoRA adapters on a built LlamaModel: its dense projections wrapped in LoraLinear,
each adapter's fused factors added to them.

On a W8A8 base the factors follow SmoothQuant (model.smoothing): a projection sees x / s, so
A's input rows are scaled by s; the up projection's outputs are divided by the down
projection's s, so B's rows of the up part are too.

Not served (refused here with the reason): OLMoE's full q/k norm, and MLP targets on a
mixture-of-experts layer.
"""

from __future__ import annotations

import torch

from pipellm.services.compute.lora.weights import fuse, part_sizes, read_factors
from pipellm.services.compute.model.arch import qkv_rows
from pipellm.services.compute.model.linear.lora import LoraLinear
from pipellm.shared.lora import AdapterConfig, LoraError, LoraModule

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def attach_adapters(model, modules: list[LoraModule], max_lora_rank: int) -> None:
    """Wrap `model`'s projections (once) and give every adapter of `modules` the next slot of
    every projection's stacks (`model.lora_slots`), in the model's dtype and on its device.
    LoraError for an adapter that cannot be served (then none of `modules` is added)."""
    if not modules:
        return
    cfg = model.cfg
    if cfg.qk_norm_full:
        raise LoraError("LoRA adapters are not supported for OLMoE's full q/k norm yet")
    for layer in model.layers:
        for p in PROJECTIONS:
            base = getattr(layer, p)
            if base is not None and not isinstance(base, LoraLinear):
                setattr(layer, p, LoraLinear(base, tuple(part_sizes(cfg)[p])))
    fused = [_factor_pairs(model, m, max_lora_rank) for m in modules]  # all read before any
    for module, pairs in zip(modules, fused, strict=True):
        for i, layer in enumerate(model.layers):
            for p in PROJECTIONS:
                linear = getattr(layer, p)
                if isinstance(linear, LoraLinear):
                    linear.append(pairs.get((i, p)), model.embed)
        model.lora_slots[module.name] = len(model.lora_slots)


def _factor_pairs(model, module: LoraModule, max_lora_rank: int,
                  ) -> dict[tuple[int, str], tuple]:
    """{(layer, projection): (A^T [in, r], B^T [r, out])} of every projection `module`
    targets, on the model's device and in its dtype; LoraError where the adapter does not fit
    the model."""
    cfg, dtype, device = model.cfg, model.embed.dtype, model.embed.device
    config = AdapterConfig.read(module.path)
    if config.rank > max_lora_rank:
        raise LoraError(f"LoRA adapter {module.name!r} ({module.path}) has rank "
                        f"{config.rank}, over --max-lora-rank {max_lora_rank}")
    factors = model.own_factors(read_factors(module.path))
    if any(i >= cfg.num_layers for i, _ in factors):
        raise LoraError(f"LoRA adapter {module.name!r} has factors of layers the model (of "
                        f"{cfg.num_layers}) has not: an adapter of another model?")
    pairs = {}
    for i, layer in enumerate(model.layers):
        for p in PROJECTIONS:
            fused = fuse(factors, config, cfg, i, p, dtype)
            if fused is None:
                continue
            linear = getattr(layer, p)
            if linear is None:
                raise LoraError(f"LoRA adapter {module.name!r} targets the MLP of layer {i}, "
                                "a mixture-of-experts layer: not supported")
            a, b = fused
            if model.smoothing is not None:
                a, b = _follow_smoothing(a, b, model.smoothing[i], p, cfg)
            if p == "qkv":  # the decoder's head order (partial rotary)
                b = qkv_rows(cfg, b, None)[0]
            a, b = a.to(device), b.t().contiguous().to(device=device, dtype=dtype)
            if a.shape[0] != linear.in_features or b.shape[1] != linear.out_features:
                raise LoraError(f"LoRA adapter {module.name!r}: layer {i} {p} factors "
                                f"{tuple(a.shape)} x {tuple(b.shape)} do not fit the model")
            pairs[i, p] = (a, b)
    return pairs


def _follow_smoothing(a: torch.Tensor, b: torch.Tensor, scales: dict[str, torch.Tensor],
                      projection: str, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(A^T [in, k r], B [out, k r]) of `projection` for inputs divided by its site's s (and,
    for gate_up, outputs of the up part divided by the down projection's s)."""
    s = scales.get(projection)
    if s is not None:
        a = (a.float() * s.float().cpu()[:, None]).to(a.dtype)
    if projection == "gate_up" and "down" in scales:
        inter = cfg.intermediate_size
        b = b.clone()
        b[inter:] /= scales["down"].float().cpu()[:, None]
    return a, b


def detach_adapter(model, name: str) -> None:
    """Stop serving adapter `name` on `model`: its slot dropped from every projection's stacks,
    the slots after it renumbered."""
    slot = model.lora_slots.pop(name)
    for layer in model.layers:
        for p in PROJECTIONS:
            linear = getattr(layer, p)
            if isinstance(linear, LoraLinear):
                linear.drop(slot)
    model.lora_slots = {n: s - (s > slot) for n, s in model.lora_slots.items()}
