"""The kernels package exports its public functions: callers need not know each module."""

from __future__ import annotations

import torch

from pipellm import kernels
from pipellm.kernels.rmsnorm import rms_norm_ref


def test_public_kernel_functions_are_exported_and_dispatch():
    assert all(callable(getattr(kernels, name)) for name in kernels.__all__)
    x, w = torch.randn(5, 64), torch.randn(64)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1e-5)
    assert kernels.backend() in ("auto", "reference", "triton")
