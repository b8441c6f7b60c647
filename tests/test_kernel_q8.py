"""Q8 blocks (the LM head of a 4-bit GGUF model on CPU): the quantization round trip, the C++
block kernel at every ISA level against its PyTorch reference, and which head the int4 method
builds."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.q8_gemm import (
    Q8Blocks,
    dequantize_q8,
    prepare_q8,
    q8_gemm,
    q8_gemm_ref,
    quantize_q8,
)
from pipellm.services.compute.model.linear import Linear, Q8Linear
from pipellm.services.compute.model.quantization import Quantization

BLOCKS = dispatch.block_gemm_extension(torch.empty(0)) is not None


def _weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_quantize_q8_round_trips_and_bounds_the_error():
    w = _weight(40, 96)
    q = quantize_q8(w)
    assert q.values.dtype == torch.int8 and q.scales.shape == (40, 3)
    assert int(q.values.abs().amax(-1).min()) == 127  # each row's largest block value
    back = dequantize_q8(q)
    step = q.scales.float().repeat_interleave(32, 1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    again = quantize_q8(back)  # a Q8_0 tensor's float copy gives its blocks back
    assert torch.equal(again.values, q.values) and torch.equal(again.scales, q.scales)


@pytest.mark.parametrize("M", [1, 2, 5, 9])
@pytest.mark.parametrize("N, K", [(96, 256), (40, 96), (33, 64), (24, 64)])
def test_q8_blocks_match_their_reference(block_gemm_level, M, N, K):
    w = quantize_q8(_weight(N, K, seed=M))
    prepared = prepare_q8(w)
    assert isinstance(prepared, Q8Blocks)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)) * 2
    bias = torch.randn(N)
    out = q8_gemm(x, prepared, bias)
    torch.testing.assert_close(out, q8_gemm_ref(x, w, bias), rtol=1e-5, atol=1e-4)
    float_out = x @ dequantize_q8(w).t() + bias  # INT8 activations cost little
    assert (out - float_out).norm() / float_out.norm() < 0.01


def test_q8_blocks_across_weight_groups_and_row_chunks(block_gemm_level):
    """As the Q4 test of the same name: several L2-sized groups of items, one-tile row chunks."""
    w = quantize_q8(_weight(1000, 4096, seed=7))
    x = torch.randn(42, 4096, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(q8_gemm(x, prepare_q8(w)), q8_gemm_ref(x, w), rtol=1e-5,
                               atol=1e-4)


def test_q8_blocks_extreme_values(block_gemm_level):
    """Weights of -128 (a GGUF may store them) and activations at +-127 against weights of
    +-127: the AVX2 / AVX-512BW paths' INT16 pair sums at their largest, exact."""
    n, k = 32, 64
    w = quantize_q8(_weight(n, k))
    values = torch.where(torch.arange(n * k).view(n, k) % 3 == 0, -128, 127).to(torch.int8)
    w = type(w)(values, w.scales)
    x = torch.where(torch.arange(2 * k).view(2, k) % 2 == 0, 1.0, -1.0)
    out = q8_gemm(x, prepare_q8(w))
    torch.testing.assert_close(out, q8_gemm_ref(x, w), rtol=1e-5, atol=1e-3)


def test_q8_blocks_bf16(block_gemm_level):
    w = quantize_q8(_weight(64, 128))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = q8_gemm(x, prepare_q8(w))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), q8_gemm_ref(x, w).float(), rtol=1e-2, atol=1e-2)


def test_int4_head_is_q8_only_where_the_kernel_runs():
    w = _weight(64, 96)
    assert isinstance(Quantization("int4").head(w), Q8Linear if BLOCKS else Linear)
    assert isinstance(Quantization("none").head(w), Linear)
    assert isinstance(Quantization("int4").head(_weight(64, 100)), Linear)  # K % 32 != 0


@pytest.mark.parametrize("M", [1, 5, 42])
@pytest.mark.parametrize("N, K", [(40, 96), (1000, 4096)])
def test_w8a8_through_the_block_gemms_matches_its_reference(block_gemm_level, monkeypatch, M,
                                                            N, K):
    """W8A8 on a CPU without VNNI: per-channel INT8 weights packed as Q8 blocks of scale 1,
    per-token INT8 activations: the exact INT32 sums' result, to float rounding, at every level
    (VNNI levels included: the kernel is the same), with a bias, in float32 and bf16."""
    from pipellm.kernels.cpu import isa
    from pipellm.kernels.int8_gemm import int8_blocks, int8_gemm_blocks, int8_gemm_ref
    from pipellm.kernels.int8_quant import quantize_int8_ref

    monkeypatch.setattr(isa, "int8_dot_products", lambda flags=None: False)
    w = quantize_int8_ref(_weight(N, K, seed=M))
    packed = int8_blocks(w.values)
    x = quantize_int8_ref(torch.randn(M, K, generator=torch.Generator().manual_seed(5)) * 3)
    bias = torch.randn(N)
    ref = int8_gemm_ref(x.values, x.scales, w.values, w.scales, bias, torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        out = int8_gemm_blocks(x.values, x.scales, packed, w.scales, bias, dtype)
        assert out.dtype == dtype and out.shape == (M, N)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * 10)
    assert int8_blocks(w.values[:, :K - 16]) is None  # K not whole blocks: torch._int_mm
