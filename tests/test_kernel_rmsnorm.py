"""RMSNorm kernels (pipellm/kernels/rmsnorm.py): the Triton path against the HF-exact PyTorch
reference.

On a machine without a GPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py).
Known interpreter limitation: its float32 -> bfloat16 casts truncate (round toward zero) where
the GPU rounds to nearest even, so bf16 results here are within a few bf16 ulp, not 1.
"""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.rmsnorm import (
    add_rms_norm,
    add_rms_norm_ref,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
)
from pipellm.services.compute.model.llama import rms_norm as llama_rms_norm

EPS = 1e-5
SHAPES = [(1, 96), (37, 96), (1, 1000), (37, 1000)]  # (T, hidden): hidden not a power of 2
HALF_TOL = {  # bf16: 3 ulp for the interpreter's truncating casts (see module docstring)
    torch.float16: dict(rtol=2 * 2.0**-10, atol=1e-4),
    torch.bfloat16: dict(rtol=3 * 2.0**-7, atol=1e-3),
}


@pytest.fixture
def backend():
    """Lets a test switch pipellm.kernels.dispatch's backend; restores the previous one
    afterwards."""
    previous = dispatch.backend()
    yield dispatch.set_backend
    dispatch.set_backend(previous)


def _inputs(T: int, n: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    """Random x, residual [T, n] and a non-trivial weight [n] (no zeros anywhere)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n, generator=g) * 2 + 0.1
    res = torch.randn(T, n, generator=g)
    w = torch.rand(n, generator=g) * 1.5 + 0.25  # [0.25, 1.75]
    return tuple(t.to(device=device, dtype=dtype) for t in (x, res, w))


def _dyadic(T: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Nonzero values k/8, |k| in [1, 16]: every fp32 sum of their squares is exact, in any order.

    With the reduction order out of the picture the kernel must match the reference bit-for-bit.
    """
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 17, (T, n), generator=g)  # [T, n] magnitudes
    sign = torch.randint(0, 2, (T, n), generator=g) * 2 - 1
    return (k * sign / 8).to(dtype)


def test_reference_is_llama_rms_norm():
    x, _, w = _inputs(37, 1000, torch.bfloat16)
    assert torch.equal(rms_norm_ref(x, w, EPS), llama_rms_norm(x, w, EPS))


@pytest.mark.parametrize("T,n", SHAPES)
def test_rms_norm_fp32(T, n):
    x, _, w = _inputs(T, n, torch.float32)
    out = rms_norm_triton(x, w, EPS)
    # Only the fp32 summation order differs from torch's: a few ulp at most.
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T,n", SHAPES)
def test_add_rms_norm_fp32(T, n):
    x, res, w = _inputs(T, n, torch.float32)
    out, new_res = add_rms_norm_triton(x, res, w, EPS)
    ref_out, ref_res = add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bit_exact_when_the_sum_is_exact(dtype):
    x, r = _dyadic(37, 1000, dtype, seed=1), _dyadic(37, 1000, dtype, seed=2)
    w = _inputs(1, 1000, dtype)[2]
    assert torch.equal(rms_norm_triton(x, w, EPS), rms_norm_ref(x, w, EPS))
    out, new_res = add_rms_norm_triton(x, r, w, EPS)
    ref_out, ref_res = add_rms_norm_ref(x, r, w, EPS)
    assert torch.equal(new_res, ref_res)
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,n", [(1, 96), (37, 1000)])
def test_half_dtypes(dtype, T, n):
    x, res, w = _inputs(T, n, dtype)
    out = rms_norm_triton(x, w, EPS)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), **HALF_TOL[dtype])
    out, new_res = add_rms_norm_triton(x, res, w, EPS)
    ref_out, ref_res = add_rms_norm_ref(x, res, w, EPS)
    torch.testing.assert_close(new_res, ref_res, rtol=torch.finfo(dtype).eps, atol=0)
    torch.testing.assert_close(out, ref_out, **HALF_TOL[dtype])


def test_fp32_weight_with_half_input_promotes_like_torch():
    x, _, _ = _inputs(37, 96, torch.float16)
    w = _inputs(1, 96, torch.float32)[2]
    out, ref = rms_norm_triton(x, w, EPS), rms_norm_ref(x, w, EPS)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_strided_rows_and_leading_dims():
    big = _inputs(37, 1000, torch.float32)[0]
    x = big[:, 100:196]  # [37, 96] view, row stride 1000
    w = _inputs(1, 96, torch.float32)[2]
    torch.testing.assert_close(rms_norm_triton(x, w, EPS), rms_norm_ref(x, w, EPS),
                               rtol=1e-6, atol=1e-6)
    x3 = big.view(37, 10, 100)  # [..., hidden] with two leading dims
    w3 = _inputs(1, 100, torch.float32)[2]
    out = rms_norm_triton(x3, w3, EPS)
    assert out.shape == x3.shape
    torch.testing.assert_close(out, rms_norm_ref(x3, w3, EPS), rtol=1e-6, atol=1e-6)


def test_dispatch(backend):
    x, res, w = _inputs(37, 96, torch.float32)
    backend("reference")
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    backend("triton")
    assert torch.equal(rms_norm(x, w, EPS), rms_norm_triton(x, w, EPS))
    out, new_res = add_rms_norm(x, res, w, EPS)
    assert torch.equal(out, add_rms_norm_triton(x, res, w, EPS)[0])
    assert torch.equal(new_res, res + x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,n", [(1, 4096), (4099, 5120), (513, 8192)])
def test_gpu_large(dtype, T, n):
    x, res, w = _inputs(T, n, dtype, device="cuda")
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else \
        dict(rtol=3 * torch.finfo(dtype).eps, atol=1e-5)
    assert dispatch.use_triton(x)
    torch.testing.assert_close(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), **tol)
    out, new_res = add_rms_norm(x, res, w, EPS)
    ref_out, ref_res = add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, **tol)
