"""SmoothQuant for W8A8 (Xiao et al., 2023): move the activations' outlier channels into the
weights before both are quantized to INT8.

For a projection X W^T and per-input-channel scales s: X W^T = (X / s)(W diag(s))^T. The 1/s
folds into whatever makes X, so nothing is added to a step: the RMSNorm weight before q/k/v and
before gate/up, and the up projection's rows before down (act(gate) * up is linear in up).
A mixture-of-experts layer's MLP is not smoothed: its router reads the float norm output, and
each expert quantizes its own input per token.
s_j = max|X_j|^ALPHA / max_i |W_ij|^(1 - ALPHA), ALPHA = 0.5.

max|X_j| is measured once at load by a float forward of CALIB_SEQS sequences of random token
ids (seeded): data-free, no calibration set to ship. The outlier channels of these models show
whatever the input, so random tokens calibrate nearly as well as real text (bench/
quant_accuracy.py; its figures are in docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.services.compute.kv.sizing import profile_batch
from pipellm.services.compute.model.arch import mlp_norm
from pipellm.shared.model_config import ModelConfig

ALPHA = 0.5
CALIB_SEQS, CALIB_LEN, CALIB_SEED = 8, 256, 0
_SITES = ("qkv", "gate_up", "down")


class _AbsMax:
    """A linear layer's stand-in that records max |x| per input channel, then runs it."""

    def __init__(self, linear):
        self.linear, self.absmax = linear, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().float().abs().amax(0)
        self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)
        return self.linear(x)


@torch.inference_mode()
def activation_absmax(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                      device: torch.device, build=None) -> list[dict[str, torch.Tensor]]:
    """Per layer, max |x| [in] of the inputs of qkv, gate_up and down, over the calibration
    sequences run through the float model (`build(weights, CALIB_LEN)`: a tensor-parallel
    rank's; None: a LlamaModel)."""
    from pipellm.services.compute.model.llama import LlamaModel

    model = LlamaModel(cfg, weights, device, CALIB_LEN) if build is None else \
        build(weights, CALIB_LEN)
    for layer in model.layers:
        for site in _SITES:
            if getattr(layer, site) is not None:  # a sparse layer has no dense MLP
                setattr(layer, site, _AbsMax(getattr(layer, site)))
    local = model.cfg  # a rank's KV heads
    kv = KVCache(cfg.num_layers, CALIB_LEN, local.num_kv_heads, cfg.head_dim,
                 model.embed.dtype, device)
    gen = torch.Generator().manual_seed(CALIB_SEED)
    batch = profile_batch(CALIB_LEN, 1, device)
    for _ in range(CALIB_SEQS):
        batch.input_ids.copy_(torch.randint(cfg.vocab_size, (CALIB_LEN,), generator=gen))
        model.forward(batch, kv)
    return [{site: getattr(layer, site).absmax for site in _SITES
             if getattr(layer, site) is not None} for layer in model.layers]


def smooth(cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
           build=None, whole=None) -> list[dict[str, torch.Tensor]]:
    """Rescale `weights` (HF names, float) in place as above; the float model they make
    computes the same function. Returns each layer's s [in] per site ("qkv", "gate_up",
    "down"; a MoE layer only "qkv"): what a LoRA adapter's factors must follow. A
    tensor-parallel rank's (pipellm/services/compute/tp/quantized.py): `build` its float model,
    `whole(t)` the max of a statistic of qkv's or gate_up's input over the ranks' rows."""
    absmax = activation_absmax(cfg, weights, device, build)
    whole = whole or (lambda t: t)
    scales = []
    for i, stats in enumerate(absmax):
        p = f"model.layers.{i}."
        qkv = [f"{p}self_attn.{n}_proj.weight" for n in "qkv"]
        gate_up = [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up")]
        layer = {"qkv": _fold(weights, stats["qkv"], qkv, f"{p}input_layernorm.weight",
                              rows=False, whole=whole)}
        if not cfg.is_moe_layer(i):  # the experts quantize their inputs unsmoothed
            layer["gate_up"] = _fold(weights, stats["gate_up"], gate_up,
                                     f"{p}{mlp_norm(cfg)}.weight", rows=False, whole=whole)
            layer["down"] = _fold(weights, stats["down"], [f"{p}mlp.down_proj.weight"],
                                  f"{p}mlp.up_proj.weight", rows=True)
        scales.append(layer)
    return scales


def _fold(weights: dict[str, torch.Tensor], x_absmax: torch.Tensor, consumers: list[str],
          producer: str, rows: bool, whole=lambda t: t) -> torch.Tensor:
    """Scale the consumers' input columns by s and divide the producer by s: its weight
    (a norm's [in]) or, with `rows`, its output rows (a projection's [in, ...]); s [in]
    (`whole`: the statistics' max over the ranks where the consumers' rows are split)."""
    w_absmax = whole(torch.stack([weights[n].float().abs().amax(0) for n in consumers]).amax(0))
    x_absmax = whole(x_absmax)
    s = x_absmax.clamp(min=1e-5) ** ALPHA / w_absmax.clamp(min=1e-5) ** (1 - ALPHA)
    s = s.clamp(min=1e-5).to(x_absmax.device)
    for n in consumers:
        weights[n] = (weights[n].float() * s[None, :]).to(weights[n].dtype)
    inv = (1 / s)[:, None] if rows else 1 / s
    weights[producer] = (weights[producer].float() * inv).to(weights[producer].dtype)
    return s
