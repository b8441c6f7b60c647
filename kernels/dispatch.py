"""Which implementation a kernel call runs: the Triton kernel or its PyTorch reference.

"auto" (default): Triton for CUDA tensors, the reference for CPU tensors (the server's CPU path).
"triton": always Triton (on CPU tensors only under TRITON_INTERPRET=1: how CI tests kernels).
"reference": always the PyTorch reference. Set once at start-up (`--kernels`, PIPELLM_KERNELS).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")
_backend = os.environ.get("PIPELLM_KERNELS", "auto")


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, not {name!r}")
    _backend = name


def backend() -> str:
    return _backend


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel called on tensor `t` runs its Triton implementation."""
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)
