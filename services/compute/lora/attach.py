"""Serving LoRA adapters on a built LlamaModel: its dense projections wrapped in LoraLinear,
each adapter's fused factors added to them.

Not served (refused here with the reason): W8A8 bases (SmoothQuant rescales the activations and
the up projection, which an adapter's factors would have to follow), OLMoE's full q/k norm, and
MLP targets on a mixture-of-experts layer.
"""

from __future__ import annotations

from services.compute.lora.linear import LoraLinear
from services.compute.lora.weights import fuse, read_factors
from services.compute.model.arch import qkv_rows
from shared.lora import AdapterConfig, LoraError, LoraModule

PROJECTIONS = ("qkv", "o", "gate_up", "down")


def attach_adapters(model, modules: list[LoraModule], max_lora_rank: int) -> None:
    """Wrap `model`'s projections (once) and load every adapter of `modules` onto them, in the
    model's dtype and on its device. LoraError for an adapter that cannot be served."""
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
                setattr(layer, p, LoraLinear(base))
    dtype, device = model.embed.dtype, model.embed.device
    for module in modules:
        config = AdapterConfig.read(module.path)
        if config.rank > max_lora_rank:
            raise LoraError(f"LoRA adapter {module.name!r} ({module.path}) has rank "
                            f"{config.rank}, over --max-lora-rank {max_lora_rank}")
        factors = read_factors(module.path)
        for i, layer in enumerate(model.layers):
            for p in PROJECTIONS:
                fused = fuse(factors, config, cfg, i, p, dtype)
                if fused is None:
                    continue
                if getattr(layer, p) is None:
                    raise LoraError(f"LoRA adapter {module.name!r} targets the MLP of layer "
                                    f"{i}, a mixture-of-experts layer: not supported")
                a, b = fused
                if p == "qkv":  # the decoder's head order (partial rotary)
                    b = qkv_rows(cfg, b, None)[0]
                getattr(layer, p).add(module.name, a.to(device),
                                      b.t().contiguous().to(device=device, dtype=dtype))
    model.lora_names = frozenset(model.lora_names | {m.name for m in modules})


def detach_adapter(model, name: str) -> None:
    """Stop serving adapter `name` on `model` (its factors dropped from every projection)."""
    for layer in model.layers:
        for p in PROJECTIONS:
            linear = getattr(layer, p)
            if isinstance(linear, LoraLinear):
                linear.adapters.pop(name, None)
    model.lora_names = model.lora_names - {name}
