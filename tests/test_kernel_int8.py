"""W8A8 kernels: the INT8 GEMM (Triton, CPU `torch._int_mm`) and the per-token activation
quantization (plain, fused with SiLU x mul, fused with add + RMSNorm), each against its PyTorch
reference on random inputs; the Triton kernels run under the interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.int8_gemm import int8_gemm, int8_gemm_cpu, int8_gemm_ref, int8_gemm_triton
from pipellm.kernels.int8_quant import (
    _launch,
    quantize_fp8_rows,
    quantize_int8,
    quantize_int8_ref,
    silu_mul_int8_ref,
)
from pipellm.kernels.rmsnorm import rms_norm_int8
from pipellm.services.compute.model.linear.fp8 import quantize_fp8


@pytest.fixture
def backend():
    previous = dispatch.backend()
    yield dispatch.set_backend
    dispatch.set_backend(previous)


def _int8(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)


def _gemm_inputs(M, N, K, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return (_int8(M, K, seed=seed), torch.rand(M, generator=g) * 0.05 + 1e-3,
            _int8(N, K, seed=seed + 2), torch.rand(N, generator=g) * 0.01 + 1e-4,
            torch.randn(N, generator=g))


@pytest.mark.parametrize("M,N,K", [(1, 96, 200), (7, 130, 64), (40, 64, 577)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_triton_matches_reference(M, N, K, out_dtype, with_bias):
    xq, xs, wq, ws, bias = _gemm_inputs(M, N, K)
    bias = bias if with_bias else None
    out = int8_gemm_triton(xq, xs, wq, ws, bias, out_dtype)
    ref = int8_gemm_ref(xq, xs, wq, ws, bias, out_dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if out_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("M", [1, 3, 33])
def test_int8_gemm_cpu_path_exact_sums(M):
    xq, xs, wq, ws, bias = _gemm_inputs(M, 160, 1536, seed=3)
    torch.testing.assert_close(int8_gemm_cpu(xq, xs, wq, ws, bias, torch.float32),
                               int8_gemm_ref(xq, xs, wq, ws, bias, torch.float32),
                               rtol=1e-6, atol=1e-6)
    assert int8_gemm_cpu(xq[:0], xs[:0], wq, ws).shape == (0, 160)


def test_int8_gemm_approximates_the_float_product():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(9, 256, generator=g), torch.randn(48, 256, generator=g)
    a = quantize_int8_ref(x)
    wa = quantize_int8_ref(w)  # per-output-channel weight scales: the same row-wise rule
    out = int8_gemm(a.values, a.scales, wa.values, wa.scales, out_dtype=torch.float32)
    rel = (out - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 0 < rel < 0.02


def test_int8_gemm_refuses_mismatched_shapes():
    xq, xs, wq, ws, _ = _gemm_inputs(2, 8, 16)
    with pytest.raises(ValueError, match="K mismatch"):
        int8_gemm_ref(xq, xs, wq[:, :8], ws)
    with pytest.raises(ValueError, match="int8"):
        int8_gemm_ref(xq.float(), xs, wq, ws)


def _acts(T, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n, generator=g) * 3
    x[0, 5] = 40.0  # an outlier sets its row's scale
    return x.to(dtype)


@pytest.mark.parametrize("T,n", [(1, 96), (13, 1000), (3, 2500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_int8_triton_is_the_reference(T, n, dtype):
    x = _acts(T, n, dtype)
    out, ref = _launch(x, n, silu_mul=False), quantize_int8_ref(x)
    assert torch.equal(out.scales, ref.scales)
    assert torch.equal(out.values, ref.values)
    # a value is within half a step of its source
    err = (ref.dequantize() - x.float()).abs()
    assert (err <= ref.scales[:, None] / 2 * (1 + 1e-5)).all()
    assert ref.values.abs().max() == 127


@pytest.mark.parametrize("T,n", [(1, 96), (13, 1000), (3, 2500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_rows_triton_is_the_fp8_linears_reference(T, n, dtype):
    """The FP8 linear's activations in one launch: the same e4m3 bits and scales as its
    PyTorch chain (pipellm/services/compute/model/linear/fp8.py), a zero row included."""
    x = _acts(T, n, dtype, seed=4)
    x[-1] = 0.0
    values, scales = quantize_fp8_rows(x)
    ref_values, ref_scales = quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (T, 1)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(values.view(torch.uint8), ref_values.view(torch.uint8))
    assert values[:-1].float().abs().amax(-1).eq(448).all()  # each row's max maps to 448


def test_zero_rows_quantize_to_zero():
    x = torch.zeros(2, 64)
    for out in (_launch(x, 64, silu_mul=False), quantize_int8_ref(x)):
        assert torch.equal(out.scales, torch.zeros(2)) and not out.values.any()


def _close_int8(out, ref, max_off_by_one=0.01):
    """Scales within float32 rounding; values equal but for rare ties, by at most one step."""
    torch.testing.assert_close(out.scales, ref.scales, rtol=1e-5, atol=0)
    diff = (out.values.int() - ref.values.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= max_off_by_one


@pytest.mark.parametrize("T,inter", [(1, 64), (9, 1536), (2, 3000)])
def test_silu_mul_int8_triton_matches_reference(T, inter):
    gate_up = _acts(T, 2 * inter, torch.float32, seed=2)
    _close_int8(_launch(gate_up, inter, silu_mul=True), silu_mul_int8_ref(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_int8_triton_matches_reference(backend, dtype, with_residual):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(11, 576, generator=g) * 2).to(dtype)
    res = torch.randn(11, 576, generator=g).to(dtype)
    w = (torch.rand(576, generator=g) + 0.25).to(dtype)
    res = res if with_residual else None
    backend("triton")
    out, new_res = rms_norm_int8(x, res, w, 1e-5)
    backend("reference")
    ref, ref_res = rms_norm_int8(x, res, w, 1e-5)
    if dtype == torch.float32:
        _close_int8(out, ref)
    else:  # the interpreter's float32 -> bf16 casts truncate (see test_kernel_rmsnorm.py):
        # the normed rows differ by a bf16 ulp, so compare what the int8 rows stand for
        torch.testing.assert_close(out.dequantize(), ref.dequantize(), rtol=0,
                                   atol=2 * ref.scales.max().item())
    if with_residual:  # exact in fp32; bf16: the interpreter's truncating cast again
        torch.testing.assert_close(new_res, ref_res, rtol=2.0**-7, atol=0)
    else:
        assert new_res is None and ref_res is None


def test_dispatch_on_cpu_tensors(backend):
    x = _acts(4, 128, torch.float32)
    backend("auto")
    assert torch.equal(quantize_int8(x).values, quantize_int8_ref(x).values)
