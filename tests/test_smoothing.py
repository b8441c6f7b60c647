"""SmoothQuant at load (--quantization w8a8): the smoothed float model computes the same
function, and with an outlier channel planted the W8A8 model gets much closer to float."""

from __future__ import annotations

import torch

from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.services.compute.kv.sizing import profile_batch
from pipellm.services.compute.model import smoothing
from pipellm.services.compute.model.llama import LlamaModel
from pipellm.services.compute.model.quantization import Quantization
from pipellm.services.compute.model.weights import load_weights
from pipellm.shared.model_config import ModelConfig

CPU = torch.device("cpu")


def logits(cfg: ModelConfig, weights: dict, quant: Quantization | None = None) -> torch.Tensor:
    model = LlamaModel(cfg, weights, CPU, 64, quant)
    kv = KVCache(cfg.num_layers, 48, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    batch = profile_batch(48, 48, CPU)
    batch.input_ids.copy_(torch.arange(48) * 17 % cfg.vocab_size)
    return model.forward(batch, kv)


def planted(weights: dict, cfg: ModelConfig) -> dict:
    """The same function with channel 3 of every norm output 40x larger (the next layer's
    columns 40x smaller): an outlier channel, as real checkpoints have."""
    w = dict(weights)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm, names in ((f"{p}input_layernorm.weight", [f"{p}self_attn.{n}_proj.weight"
                                                             for n in "qkv"]),
                            (f"{p}post_attention_layernorm.weight",
                             [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up")])):
            w[norm] = w[norm].clone()
            w[norm][3] *= 40
            for n in names:
                w[n] = w[n].clone()
                w[n][:, 3] /= 40
    return w


def test_smoothing_keeps_the_function_and_tames_an_outlier(demo_model_dir):
    cfg = ModelConfig.from_path(demo_model_dir)
    base = load_weights(demo_model_dir, torch.float32)
    outlier = planted(base, cfg)
    ref = logits(cfg, base)
    torch.testing.assert_close(logits(cfg, outlier), ref, atol=1e-3, rtol=1e-3)
    smoothed = dict(outlier)
    smoothing.smooth(cfg, smoothed, CPU)
    assert not torch.equal(smoothed["model.layers.0.input_layernorm.weight"],
                           outlier["model.layers.0.input_layernorm.weight"])
    torch.testing.assert_close(logits(cfg, smoothed), ref, atol=1e-3, rtol=1e-3)
    w8a8 = Quantization("w8a8")
    err_raw = (logits(cfg, outlier, w8a8) - ref).abs().mean()
    err_smooth = (logits(cfg, smoothed, w8a8) - ref).abs().mean()
    assert err_smooth < 0.5 * err_raw
