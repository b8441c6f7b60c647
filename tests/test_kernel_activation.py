"""Gated activation kernels (pipellm/kernels/activation.py), SiLU and GELU-tanh x mul: the Triton
path against the PyTorch reference.

On a machine without a GPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py).
Known interpreter limitation: its float32 -> bfloat16 casts truncate (round toward zero) where
the GPU rounds to nearest even, so bf16 results here are within 2 bf16 ulp rather than 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipellm.kernels import dispatch
from pipellm.kernels.activation import (
    gelu_tanh_mul,
    gelu_tanh_mul_ref,
    gelu_tanh_mul_triton,
    silu_mul,
    silu_mul_ref,
    silu_mul_triton,
)

SHAPES = [(1, 96), (37, 96), (1, 1000), (37, 1000), (3, 2900)]  # (T, I); 2900 > one block


@pytest.fixture
def backend():
    """Lets a test switch pipellm.kernels.dispatch's backend; restores the previous one
    afterwards."""
    previous = dispatch.backend()
    yield dispatch.set_backend
    dispatch.set_backend(previous)


def _gate_up(T: int, inter: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """[T, 2 I] random gate | up (wide range: silu's tails and its negative dip)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 2 * inter, generator=g) * 3 + 0.01
    return x.to(device=device, dtype=dtype)


def _ideal(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64: the value both implementations round."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("T,inter", SHAPES)
def test_fp32(T, inter):
    x = _gate_up(T, inter, torch.float32)
    out = silu_mul_triton(x)
    assert out.shape == (T, inter) and out.dtype == torch.float32
    # Same operations; only exp's implementation differs (torch's vs numpy's): a few ulp.
    torch.testing.assert_close(out, silu_mul_ref(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,inter", [(1, 96), (37, 1000)])
def test_half_dtypes(dtype, T, inter):
    x = _gate_up(T, inter, dtype)
    out = silu_mul_triton(x)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps
    ideal = _ideal(x)
    # The reference rounds twice (silu, product), the kernel once: ~1 ulp apart, at most 2 with
    # the interpreter's truncating bf16 casts. The kernel's own error is one rounding.
    torch.testing.assert_close(out, silu_mul_ref(x), rtol=2 * eps, atol=1e-5)
    kernel_err = (out.double() - ideal).abs()
    assert (kernel_err <= eps * ideal.abs() + 1e-6).all()


def test_strided_rows_and_leading_dims():
    big = _gate_up(37, 600, torch.float32)  # [37, 1200]
    x = big[:, 8:200]  # [37, 192] view, row stride 1200 -> I = 96
    torch.testing.assert_close(silu_mul_triton(x), silu_mul_ref(x), rtol=1e-6, atol=1e-7)
    x3 = big.view(37, 3, 400)  # [..., 2I] with two leading dims
    out = silu_mul_triton(x3)
    assert out.shape == (37, 3, 200)
    torch.testing.assert_close(out, silu_mul_ref(x3), rtol=1e-6, atol=1e-7)


def test_dispatch(backend):
    x = _gate_up(5, 96, torch.float32)
    backend("reference")
    assert torch.equal(silu_mul(x), silu_mul_ref(x))
    backend("triton")
    assert torch.equal(silu_mul(x), silu_mul_triton(x))


# --- GELU-tanh x mul (Gemma's MLP: gelu_pytorch_tanh(gate) * up) -----------------------------


@pytest.mark.parametrize("dtype,T,inter", [(torch.float32, 1, 96), (torch.float32, 3, 2900),
                                           (torch.bfloat16, 37, 1000)])
def test_gelu_tanh_mul(backend, dtype, T, inter):
    x = _gate_up(T, inter, dtype, seed=T)
    x[0, :6] = torch.tensor([-30.0, -9.0, -0.5, 0.0, 9.0, 30.0])  # both tails: no overflow
    out = gelu_tanh_mul_triton(x)
    assert out.shape == (T, inter) and out.dtype == dtype
    eps = torch.finfo(dtype).eps
    # vs the reference: its 1 + tanh(u) cancels for very negative gates (absolute error ~ eps32
    # |gate * up|); in bf16 it also rounds twice (gelu, product), the kernel once
    rtol = 1e-6 if dtype == torch.float32 else 2 * eps
    torch.testing.assert_close(out, gelu_tanh_mul_ref(x), rtol=rtol, atol=1e-5)
    ulps = 1 if dtype == torch.bfloat16 else 4  # bf16: one rounding; fp32: exp's few ulp too
    ideal = _ideal_gelu(x)
    assert ((out.double() - ideal).abs() <= ulps * eps * ideal.abs() + 1e-6).all()
    backend("auto")  # a CPU tensor: the reference (no C++ kernel)
    assert torch.equal(gelu_tanh_mul(x), gelu_tanh_mul_ref(x))
    backend("triton")
    assert torch.equal(gelu_tanh_mul(x), out)


def _ideal_gelu(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up in float64."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,inter", [(1, 14336), (4099, 14336), (513, 11008)])
def test_gpu_large(dtype, T, inter):
    x = _gate_up(T, inter, dtype, device="cuda")
    assert dispatch.use_triton(x)
    out = silu_mul(x)
    # fp32: tl.exp is ex2.approx on NVIDIA GPUs, ~1e-6 relative for |x| up to ~15.
    # fp16/bf16: the reference's two roundings vs the kernel's one, <= 1.5 ulp.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else \
        dict(rtol=2 * torch.finfo(dtype).eps, atol=1e-5)
    torch.testing.assert_close(out, silu_mul_ref(x), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_gelu_tanh_mul(dtype):
    x = _gate_up(513, 11008, dtype, device="cuda")
    out = gelu_tanh_mul(x)  # auto on CUDA: Triton
    ideal = _ideal_gelu(x)  # one rounding of the kernel, plus ex2.approx's few fp32 ulp
    assert ((out.double() - ideal).abs() <= 4 * torch.finfo(dtype).eps * ideal.abs() + 1e-5).all()
    rtol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out, gelu_tanh_mul_ref(x), rtol=rtol, atol=1e-5)
