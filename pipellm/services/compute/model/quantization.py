"""Quantization methods (`--quantization` none, w8a8, int4, fp8, auto): which linear layer each
decoder projection becomes, and whether its input activations come quantized from the fused
norm and SiLU kernels. The embedding and norms keep the model's dtype; so does the LM head, but
under int4 on an x86 CPU with AVX2 or better (Q8_0 blocks x INT8 activations). Mixture-of-experts
experts take a method only on CPU; on a GPU it is refused (auto: none).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipellm.kernels.dispatch import block_gemm_extension
from pipellm.kernels.int4_weight import Int4Weight, dequantize_int4, quantize_int4
from pipellm.kernels.q8_gemm import dequantize_q8, quantize_q8
from pipellm.services.compute.model.linear import (
    Fp8Linear,
    Int4Linear,
    Linear,
    Q8Linear,
    W8A8Linear,
    amx,
)
from pipellm.shared.gguf.reader import is_gguf, open_gguf

log = logging.getLogger("pipellm.compute")
METHODS = ("auto", "none", "w8a8", "int4", "fp8")
GGUF_INT4_TYPES = ("Q4_0", "Q4_1")  # the GGUF block types Int4Weight represents exactly


@dataclass(frozen=True)
class Quantization:
    """One method: `linear(weight, bias)` builds a projection; `int8_activations` says the
    model hands W8A8 layers their input already quantized; `amx_rows`: int4 layers keep a bf16
    copy for steps with many rows."""

    name: str = "none"
    int4_group_size: int = 32
    dtype: torch.dtype = torch.float32
    amx_rows: bool = False

    @property
    def int8_activations(self) -> bool:
        return self.name == "w8a8"

    @property
    def keeps_gguf_blocks(self) -> bool:
        """Whether the loader hands Q4_0/Q4_1 tensors over as Int4Weight (not dequantized)."""
        return self.name == "int4"

    def linear(self, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None):
        if self.name == "int4" or isinstance(weight, Int4Weight):
            if not self.amx_rows:
                return Int4Linear(weight, bias, self.int4_group_size, self.dtype)
            if isinstance(weight, torch.Tensor):
                weight = quantize_int4(weight, self.int4_group_size)
            return amx.AmxRows(Int4Linear(weight, bias, self.int4_group_size, self.dtype),
                               dequantize_int4(weight), bias, amx.PROJECTION_MIN_ROWS)
        if self.name == "w8a8":
            return W8A8Linear(weight, bias)
        if self.name == "fp8":
            return Fp8Linear(weight, bias)
        return Linear(weight, bias)

    def head(self, weight: torch.Tensor):
        """The LM head [vocab, hidden]: Q8 blocks under int4 where the block GEMMs run, else
        float."""
        if self.name == "int4" and weight.shape[1] % 32 == 0 and block_gemm_extension(weight):
            if not self.amx_rows:
                return Q8Linear(weight)
            q = quantize_q8(weight)
            return amx.AmxRows(Q8Linear(q), dequantize_q8(q), None, amx.HEAD_MIN_ROWS)
        return Linear(weight)


def resolve(name: str, model: str, device: torch.device, dtype: torch.dtype,
            int4_group_size: int = 32) -> Quantization:
    """The method `--quantization name` means for this model and device; ValueError (a clear
    start-up message) where it cannot run."""
    if name not in METHODS:
        raise ValueError(f"--quantization must be one of {', '.join(METHODS)}, not {name!r}")
    moe_gpu = device.type == "cuda" and _is_moe(model)
    if name == "auto":
        name = "int4" if gguf_int4(model) and not moe_gpu else "none"
    if moe_gpu and name != "none":
        raise ValueError(f"--quantization {name} is not supported for mixture-of-experts models "
                         "on a GPU (the fused MoE kernel runs float experts): use none, or the "
                         "CPU")
    if name == "fp8":
        _check_fp8(device, dtype)
    if name == "w8a8" and device.type == "cpu" and not _int8_gemms_fast():
        log.warning("--quantization w8a8 on this CPU (neither VNNI nor the C++ block GEMMs): "
                    "PyTorch's INT8 GEMM runs 1.5-20x slower than float32 here; none is faster")
    return Quantization(name, int4_group_size, dtype, name == "int4" and amx.available(device))


def gguf_int4(model: str) -> bool:
    """Whether `model` is a GGUF file whose projection weights are all Q4_0/Q4_1 blocks."""
    from pipellm.shared.gguf.names import kept_int4
    if not model or not is_gguf(model):
        return False
    types = {info.qtype.name for name, info in open_gguf(model).tensors.items()
             if kept_int4(name) and len(info.shape) >= 2}  # 3-D: stacked experts
    return bool(types) and types <= set(GGUF_INT4_TYPES)


def _is_moe(model: str) -> bool:
    """Whether `model` (a directory or GGUF file) is a mixture of experts; False where its
    config cannot be read (the model loader reports that)."""
    from pipellm.shared.model_config import ModelConfig, ModelLoadError

    try:
        return ModelConfig.from_path(model).num_experts > 0
    except (ModelLoadError, OSError):
        return False


def _int8_gemms_fast() -> bool:
    """Whether W8A8's INT8 GEMMs run fast on this CPU: oneDNN's with VNNI, else the C++ block
    GEMMs' (pipellm/kernels/int8_gemm.py)."""
    from pipellm.kernels.cpu import isa

    return isa.int8_dot_products() or block_gemm_extension(torch.empty(0)) is not None


def _check_fp8(device: torch.device, dtype: torch.dtype) -> None:
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use w8a8 or int4")
    if dtype != torch.bfloat16:
        raise ValueError("--quantization fp8 on a GPU runs with --dtype bfloat16 (row-wise "
                         "scaled FP8 GEMMs write bfloat16)")
