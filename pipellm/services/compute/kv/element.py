"""The KV cache's element type, resolved once at start-up from --kv-cache-dtype, the model's
dtype, the device and --kernels, and checked there (a ValueError names what cannot run)."""

from __future__ import annotations

import torch

from pipellm.kernels.kv_quant import KV_GROUP
from pipellm.shared.config import EngineConfig
from pipellm.shared.model_config import ModelConfig


def kv_shape(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
             device: torch.device) -> dict:
    """KVCache's arguments but capacity and device (checked: ValueError where the cache's
    dtype cannot run)."""
    kv_dtype = kv_cache_dtype(config, dtype, device)
    _check_kv_dtype(kv_dtype, config.kernels, model_config.head_dim, dtype, device)
    return dict(num_layers=model_config.num_layers, num_kv_heads=model_config.num_kv_heads,
                head_dim=model_config.head_dim, dtype=dtype, kv_dtype=kv_dtype)


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> str:
    """--kv-cache-dtype as the cache is made: `auto` is float16 where a float32 model generates
    on the CPU kernels (--kernels auto: each step's decode attention then reads half the bytes;
    llama.cpp's default cache type), else the model's own dtype (auto; a pooling forward reads
    its keys once, in the step that writes them: rounding them would buy it nothing)."""
    if config.kv_cache_dtype == "auto" and dtype == torch.float32 and device.type == "cpu" \
            and config.kernels == "auto" and not config.pooling:
        return "float16"
    return config.kv_cache_dtype


def _check_kv_dtype(kv_dtype: str, kernels: str, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> None:
    """ValueError (a start-up message) where --kv-cache-dtype cannot run."""
    runs = f"{str(dtype).removeprefix('torch.')} on {device.type}"
    if kv_dtype == "float32" and dtype != torch.float32:
        raise ValueError(f"--kv-cache-dtype float32 is for a float32 model; this one runs in "
                         f"{runs}: use auto")
    if kv_dtype == "float16" and (dtype != torch.float32 or device.type != "cpu"
                                  or kernels == "triton"):
        raise ValueError(f"--kv-cache-dtype float16 is for a model run in float32 on a CPU by "
                         f"its C++ or reference kernels; this one runs in {runs} with "
                         f"--kernels {kernels}: use auto")
    if kv_dtype == "int8" and head_dim % KV_GROUP:
        raise ValueError(f"--kv-cache-dtype int8 needs head_dim a multiple of {KV_GROUP}")
    if kv_dtype == "fp8" and device.type == "cuda" and \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"--kv-cache-dtype fp8 needs FP8 conversions (compute capability 8.9+: "
                         f"Ada, Hopper); {torch.cuda.get_device_name(device)} has "
                         f"{torch.cuda.get_device_capability(device)}: use int8")
