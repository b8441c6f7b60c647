"""model/linear/dense.py: the oneDNN-packed CPU path against F.linear, random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import dispatch
from services.compute.model.linear import Linear


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
