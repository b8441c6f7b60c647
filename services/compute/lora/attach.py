"""Serving LoRA adapters on a built LlamaModel: its dense projections wrapped in LoraLinear,
each adapter's fused factors added to them.

Not served (refused here with the reason): W8A8 bases (SmoothQuant rescales the activations and
the up projection, which an adapter's factors would have to follow), OLMoE's full q/k norm, and
MLP targets on a mixture-of-experts layer.
"""

from __future__ import annotations

from services.compute.lora.weights import fuse, part_sizes, read_factors
from services.compute.model.arch import qkv_rows
from services.compute.model.linear.lora import LoraLinear
from shared.lora import AdapterConfig, LoraError, LoraModule

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def attach_adapters(model, modules: list[LoraModule], max_lora_rank: int) -> None:
    """Wrap `model`'s projections (once) and give every adapter of `modules` the next slot of
    every projection's stacks (`model.lora_slots`), in the model's dtype and on its device.
    LoraError for an adapter that cannot be served (then none of `modules` is added)."""
    if not modules:
        return
    cfg = model.cfg
    if model.quant.int8_activations:
        raise LoraError("LoRA adapters are not supported with --quantization w8a8 yet")
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
    factors = read_factors(module.path)
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
            if p == "qkv":  # the decoder's head order (partial rotary)
                b = qkv_rows(cfg, b, None)[0]
            a, b = a.to(device), b.t().contiguous().to(device=device, dtype=dtype)
            if a.shape[0] != linear.in_features or b.shape[1] != linear.out_features:
                raise LoraError(f"LoRA adapter {module.name!r}: layer {i} {p} factors "
                                f"{tuple(a.shape)} x {tuple(b.shape)} do not fit the model")
            pairs[i, p] = (a, b)
    return pairs


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
