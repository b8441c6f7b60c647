"""Float linear layers: a weight prepared once for the device's fastest GEMM.

On a CPU, `F.linear` goes to MKL's sgemm, which is slow for the shapes serving has: a decode
step's few rows and the wide LM head. oneDNN with the weight reordered once into its blocked
layout (what PyTorch's inductor does for frozen CPU models) runs those faster on the same
cores (docs/benchmarks.md, "Figures moved out of the code"). On CUDA, with `--kernels reference`, or
where oneDNN cannot take the weight (float16; bfloat16 without AVX512-BF16 or AVX-NE-CONVERT),
`F.linear` on the plain weight.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pipellm.kernels.dispatch import backend

log = logging.getLogger(__name__)
_PACK_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; good from 1 to 512 rows


class Linear:
    """y = x @ weight^T + bias. weight [out, in], bias [out] or None; x [T, in] -> [T, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.packed = _onednn_pack(weight)
        # the plain weight is kept only when it is what runs (a packed copy would double it)
        self.weight = weight if self.packed is None else None

    def nbytes(self) -> int:
        w = self.packed if self.packed is not None else self.weight
        return w.numel() * w.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout, or None where the plain F.linear path applies."""
    dtype_ok = weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not (weight.device.type == "cpu" and backend() == "auto" and dtype_ok
            and torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS_HINT)
    except (RuntimeError, AttributeError) as exc:  # an op this torch build lacks
        log.warning("oneDNN linear unavailable (%s); using F.linear", exc)
        return None
