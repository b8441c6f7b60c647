"""Which implementation a kernel call runs: the Triton kernel, a C++ CPU kernel, or the PyTorch
reference.

"auto" (default): Triton for CUDA tensors; for CPU tensors the kernel's CPU implementation where
it has one (C++ in pipellm/kernels/cpu, where it builds; or PyTorch arranged for CPU speed), else
the reference (the server's CPU path).
"triton": always Triton (on CPU tensors only under TRITON_INTERPRET=1: how CI tests kernels).
"reference": always the PyTorch reference. Set once at start-up (`--kernels`, PIPELLM_KERNELS).
"""

from __future__ import annotations

import os

import torch

from pipellm.kernels.cpu import extension

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


def cpu_fast_path(t: torch.Tensor) -> bool:
    """Whether a call on tensor `t` takes a kernel's CPU implementation (C++ or PyTorch written
    for CPU speed) rather than its reference: "auto" on a CPU tensor."""
    return _backend == "auto" and not t.is_cuda


def cpu_extension(t: torch.Tensor):
    """The C++ CPU kernels module when a call on tensor `t` should use it, else None."""
    return extension() if cpu_fast_path(t) else None


def block_gemm_extension(t: torch.Tensor):
    """`cpu_extension(t)` when its block GEMMs run on this CPU (an x86 ISA level,
    pipellm/kernels/cpu/isa.py), else None."""
    ext = cpu_extension(t)
    return ext if ext is not None and ext.block_gemm_isa() else None
