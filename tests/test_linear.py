"""model/linear/dense.py: the oneDNN-packed CPU path against F.linear, random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipellm.kernels import dispatch
from pipellm.services.compute.model.linear import Linear


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("out_f,in_f,bias", [(96, 64, False), (1000, 64, False),
                                             (40, 130, True)])
def test_packed_linear_matches_f_linear(rows, out_f, in_f, bias):
    g = torch.Generator().manual_seed(rows + out_f)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    x = torch.randn(rows, in_f, generator=g)
    lin = Linear(w, b)
    assert lin.packed is not None and lin.weight is None  # the oneDNN path, plain weight freed
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_bfloat16_is_packed_where_the_cpu_has_it():
    w, x = torch.randn(256, 128).bfloat16(), torch.randn(5, 128).bfloat16()
    lin = Linear(w)
    assert (lin.packed is not None) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.testing.assert_close(lin(x).float(), F.linear(x, w).float(), atol=5e-2, rtol=2e-2)


def test_reference_backend_and_float16_use_f_linear():
    w, x = torch.randn(32, 16), torch.randn(4, 16)
    dispatch.set_backend("reference")
    try:
        lin = Linear(w)
    finally:
        dispatch.set_backend("auto")
    assert lin.packed is None and torch.equal(lin(x), F.linear(x, w))
    half = Linear(w.half())
    assert half.packed is None and torch.equal(half(x.half()), F.linear(x.half(), w.half()))


def _int4(out_f: int, in_f: int, seed: int):
    from pipellm.kernels.int4_weight import quantize_int4

    return quantize_int4(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
                         * 0.05)


@pytest.mark.parametrize("bias", [False, True])
def test_amx_rows_runs_the_block_gemm_below_min_rows_and_bf16_from_it(bias):
    from pipellm.kernels.int4_weight import dequantize_int4
    from pipellm.services.compute.model.linear import Int4Linear
    from pipellm.services.compute.model.linear.amx import AmxRows

    w = _int4(200, 96, 1)
    b = torch.randn(200) if bias else None
    small, dense = Int4Linear(w, b), dequantize_int4(w)
    layer = AmxRows(small, dense, b, min_rows=8)
    assert layer.nbytes() == small.nbytes() + 2 * dense.numel()
    g = torch.Generator().manual_seed(2)
    few, many = torch.randn(7, 96, generator=g), torch.randn(40, 96, generator=g)
    assert torch.equal(layer(few), small(few))
    out = layer(many)
    assert out.dtype == torch.float32 and not torch.equal(out, small(many))  # bf16 ran
    torch.testing.assert_close(out, F.linear(many, dense, b), atol=3e-2, rtol=2e-2)
    half = AmxRows(small, dense, b, min_rows=8)(many.bfloat16())
    assert half.dtype == torch.bfloat16


def test_amx_rows_only_at_the_amx_level_with_the_cpu_kernels(monkeypatch):
    from pipellm.kernels.cpu import isa
    from pipellm.services.compute.model.linear import Int4Linear, amx
    from pipellm.services.compute.model.quantization import resolve

    cpu = torch.device("cpu")
    monkeypatch.setattr(isa, "selected", lambda: "avx512_vnni")
    assert not amx.available(cpu) and not resolve("int4", "", cpu, torch.float32).amx_rows
    monkeypatch.setattr(isa, "selected", lambda: "amx")
    assert amx.available(cpu) and not amx.available(torch.device("cuda"))
    quant = resolve("int4", "", cpu, torch.float32)
    assert quant.amx_rows and not resolve("none", "", cpu, torch.float32).amx_rows
    layer = quant.linear(_int4(64, 64, 3))
    assert isinstance(layer, amx.AmxRows) and isinstance(layer.small, Int4Linear)
    assert isinstance(quant.linear(torch.randn(64, 64)), amx.AmxRows)  # quantized here first
    dispatch.set_backend("reference")
    try:
        assert not amx.available(cpu)
    finally:
        dispatch.set_backend("auto")
