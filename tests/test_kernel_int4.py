"""W4A16: the INT4 layout and our float -> INT4 quantization, the Triton GEMM (under the
interpreter without a GPU) and the CPU path, each against the PyTorch reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipellm.kernels import arrivals, dispatch
from pipellm.kernels import int4_gemm as int4_module
from pipellm.kernels.cpu import extension
from pipellm.kernels.int4_cpu import Int4Blocks, Int4Cpu, int4_q8_gemm_ref, pack_int4_cpu
from pipellm.kernels.int4_gemm import (
    SMALL_M,
    GemmTiling,
    dequantize_int4_triton,
    gemm_tiling,
    int4_gemm,
    int4_gemm_ref,
    int4_gemm_triton,
    prepare_int4,
)
from pipellm.kernels.int4_weight import (
    Int4Weight,
    dequantize_int4,
    pack_nibbles,
    quantize_int4,
    unpack_nibbles,
)
from pipellm.kernels.q8_gemm import prepare_q8, q8_gemm, quantize_q8

BLOCKS = extension() is not None and bool(extension().block_gemm_isa())


@pytest.fixture
def backend():
    previous = dispatch.backend()
    yield dispatch.set_backend
    dispatch.set_backend(previous)


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05 + 0.01


def test_nibbles_round_trip():
    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(1))
    packed = pack_nibbles(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(q[0, 0]) | int(q[0, 1]) << 4  # even k in the low nibble
    assert torch.equal(unpack_nibbles(packed), q.to(torch.uint8))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_int4_error_is_half_a_step(group):
    w = _weight(24, 256)
    q = quantize_int4(w, group)
    assert q.scales.shape == (24, 256 // group) and q.nbytes() < w.numel() * 4 / 4
    err = (dequantize_int4(q) - w).abs()
    assert (err <= q.scales.repeat_interleave(group, 1) / 2 + 1e-6).all()


def test_quantizing_grid_values_is_lossless():
    """A weight already on a 4-bit grid (a GGUF Q4_1 file's float copy) comes back exactly."""
    q = quantize_int4(_weight(8, 64), 32)
    again = quantize_int4(dequantize_int4(q), 32)
    torch.testing.assert_close(dequantize_int4(again), dequantize_int4(q), rtol=0, atol=1e-6)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        quantize_int4(_weight(4, 96), 64)
    with pytest.raises(ValueError, match="do not fit"):
        quantize_int4(_weight(4, 96), 48)


def test_cat_fuses_along_n():
    a, b = quantize_int4(_weight(8, 64, 1)), quantize_int4(_weight(4, 64, 2))
    both = Int4Weight.cat([a, b])
    assert both.shape == (12, 64)
    assert torch.equal(dequantize_int4(both), torch.cat([dequantize_int4(a), dequantize_int4(b)]))


@pytest.mark.parametrize("M,N,K,group", [(1, 48, 64, 32), (5, 100, 256, 64), (40, 72, 256, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_gemm_triton_matches_reference_fp32(M, N, K, group, with_bias):
    w = quantize_int4(_weight(N, K), group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(N) if with_bias else None
    torch.testing.assert_close(int4_gemm_triton(x, w, bias), int4_gemm_ref(x, w, bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tiling", [GemmTiling(16, 32, 32, split_k=2),
                                    GemmTiling(16, 64, 32, split_k=4),  # N tiles past N
                                    GemmTiling(16, 16, 32, split_k=3)])  # uneven K share
@pytest.mark.parametrize("group", [32, 64])
def test_split_k_tilings_match_the_reference(tiling, group, fused):
    """Split along K, the partials added by a second launch or (fused) by each tile's last
    split, which leaves the arrival counters zero: a second launch (a graph replay) is right
    too."""
    w = quantize_int4(_weight(40, 512), group)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(40)
    for _ in range(2 if fused else 1):
        out = int4_gemm_triton(x, w, bias, replace(tiling, fused=fused))
        torch.testing.assert_close(out, int4_gemm_ref(x, w, bias), rtol=1e-5, atol=1e-5)
    if fused:
        assert not arrivals.counters(x.device, 1).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 128])
def test_dequantize_triton_is_the_reference_weight(dtype, group):
    w = quantize_int4(_weight(70, 256), group).to("cpu", dtype)
    want = dequantize_int4(w).to(dtype)
    ulp = 0 if dtype == torch.float32 else 2**-7  # the interpreter's bf16 rounding may differ
    torch.testing.assert_close(dequantize_int4_triton(w, dtype), want, rtol=ulp, atol=0)


def test_more_rows_than_small_m_dequantize_and_multiply(monkeypatch):
    """Above SMALL_M rows (without a tiling) the weight is dequantized and F.linear multiplies."""
    w = quantize_int4(_weight(48, 128), 64)
    x, bias = torch.randn(SMALL_M + 1, 128), torch.randn(48)
    calls = []
    monkeypatch.setattr(int4_module, "dequantize_int4_triton",
                        lambda *a: calls.append(1) or dequantize_int4_triton(*a))
    torch.testing.assert_close(int4_gemm_triton(x, w, bias), int4_gemm_ref(x, w, bias),
                               rtol=1e-5, atol=1e-5)
    int4_gemm_triton(x[:SMALL_M], w, bias)
    assert calls == [1]


def test_gemm_tiling_splits_k_for_few_rows():
    assert gemm_tiling(1, 4096, 4096, 128) == GemmTiling(16, 128, 64, split_k=16)  # H200's best
    assert gemm_tiling(16, 14336, 4096, 128).split_k == 8
    assert gemm_tiling(1, 14336, 4096, 32).block_k == 32
    assert gemm_tiling(1, 128, 256, 32).split_k == 2  # each split keeps >= 4 K blocks
    assert gemm_tiling(17, 4096, 4096, 128).split_k == 1
    assert gemm_tiling(1, 64, 96, 32).block_k == 32  # a K block lies in one group
    with pytest.raises(ValueError, match="divide the group"):
        int4_gemm_triton(torch.randn(1, 128), quantize_int4(_weight(8, 128), 32),
                         tiling=GemmTiling(16, 16, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gpu_gemv_tilings(dtype, m):
    """On CUDA the nibbles unpack by inline PTX: the GEMV's tilings (split along K, the
    partials added by a second launch or by each tile's last split, the widest blocks the
    sweep tries) against the reference, twice each (the counters left zero)."""
    w = quantize_int4(_weight(4096, 1024), 128).to("cuda", dtype)
    x = torch.randn(m, 1024, generator=torch.Generator().manual_seed(m)).to("cuda", dtype)
    bias = torch.randn(4096).to("cuda", dtype)
    want = int4_gemm_ref(x, w, bias).float()
    for t in (gemm_tiling(m, 4096, 1024, 128), GemmTiling(16, 256, 64, 4, 8),
              GemmTiling(16, 128, 128, 4)):
        for fused in (False, True):
            for _ in range(2):
                out = int4_gemm_triton(x, w, bias, replace(t, fused=fused))
                torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_int4_gemm_triton_bf16(interpreter_bf16_dot):
    w = quantize_int4(_weight(64, 128), 32).to("cpu", torch.bfloat16)
    x = torch.randn(3, 7, 128).bfloat16()
    out = int4_gemm_triton(x, w)
    assert out.shape == (3, 7, 64) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, int4_gemm_ref(x, w), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("M", [1, 4, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_torch_cpu_path_matches_reference(M, dtype):
    w = quantize_int4(_weight(96, 256), 32)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    bias = torch.randn(96).to(dtype)
    out = int4_gemm(x, pack_int4_cpu(w), bias)
    ref = int4_gemm_ref(x, w, bias)
    assert out.dtype == dtype
    # bfloat16 activations, scales and zeros: ~3 significant digits
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=3e-2)


def test_prepare_int4_picks_the_block_kernel_where_it_runs(backend):
    backend("auto")
    prepared = prepare_int4(quantize_int4(_weight(32, 64), 32))
    assert isinstance(prepared, Int4Blocks if BLOCKS else Int4Cpu)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9, 37])
@pytest.mark.parametrize("N, K, group", [(96, 256, 32), (40, 96, 32), (33, 128, 64),
                                          (160, 384, 128), (24, 64, 32)])
def test_int4_blocks_match_their_reference(backend, block_gemm_level, M, N, K, group):
    """At every ISA level: N not a multiple of 16 (padded tiles; 24: a half-empty tile, whose
    AVX2 half of 8 rows is all padding), K with an odd number of blocks, groups of 64 and 128
    (split into blocks of 32), M not a multiple of the 4-row tile."""
    backend("auto")
    w = quantize_int4(_weight(N, K, seed=M), group)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(5)) * 3
    bias = torch.randn(N)
    out = int4_gemm(x, prepare_int4(w), bias)
    torch.testing.assert_close(out, int4_q8_gemm_ref(x, w, bias), rtol=1e-5, atol=1e-4)
    # and the INT8 activations cost little against the float product: ~0.5% of its norm
    ref = int4_gemm_ref(x, w, bias)
    assert (out - ref).norm() / ref.norm() < 0.01


def test_int4_blocks_across_weight_groups_and_row_chunks(backend, block_gemm_level):
    """K = 4096: a work item's weights are 16-64 KB (8 to 32 rows, by level), so N = 1000 spans
    several of the kernel's L2-sized groups of items (the last one short, its last tile half
    padding) and 4 KB of a row's activations makes a chunk of one 4-row tile; 42 rows: ten
    chunks and a tail."""
    backend("auto")
    w = quantize_int4(_weight(1000, 4096, seed=7), 32)
    x = torch.randn(42, 4096, generator=torch.Generator().manual_seed(8))
    out = int4_gemm(x, prepare_int4(w))
    torch.testing.assert_close(out, int4_q8_gemm_ref(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("nbytes", [0, 64, 2048, 1 << 20])
def test_prefetch_changes_no_block_gemm_result(backend, block_gemm_level, nbytes):
    """The pass that streams the weights prefetches `nbytes` ahead (0: none; 1 MB: past the
    end of the weight): Q4 and Q8, one row and a chunk and a tail of rows, give the same bits as
    with the level's own distance; a distance below -1 is refused."""
    backend("auto")
    ext = extension()
    w4 = prepare_int4(quantize_int4(_weight(1000, 576, seed=5), 32))
    w8 = prepare_q8(quantize_q8(_weight(1000, 576, seed=6)))
    xs = [torch.randn(m, 576, generator=torch.Generator().manual_seed(m)) for m in (1, 9)]
    outs = [(int4_gemm(x, w4), q8_gemm(x, w8)) for x in xs]
    try:
        ext.set_block_gemm_prefetch(nbytes)
        again = [(int4_gemm(x, w4), q8_gemm(x, w8)) for x in xs]
    finally:
        ext.set_block_gemm_prefetch(-1)
    for (q4, q8), (q4b, q8b) in zip(outs, again, strict=True):
        assert torch.equal(q4, q4b) and torch.equal(q8, q8b)
    with pytest.raises(RuntimeError, match="prefetch"):
        ext.set_block_gemm_prefetch(-2)


def test_int4_blocks_extreme_values(backend, block_gemm_level):
    """Every nibble 15 against activations of 127 (one sign, then alternating): the AVX2 /
    AVX-512BW paths' INT16 block sums at their largest (8 x 2 x 15 x 127), exact."""
    backend("auto")
    n, k = 32, 128
    ones = torch.ones(n, k // 32)
    w = Int4Weight(torch.full((n, k // 2), 0xFF, dtype=torch.uint8), ones * 0.01, ones * -0.05,
                   32)
    for x in (torch.full((3, k), -2.0), torch.where(torch.arange(3 * k) % 2 == 0, 2.0,
                                                     -2.0).view(3, k)):
        out = int4_gemm(x, prepare_int4(w))
        torch.testing.assert_close(out, int4_q8_gemm_ref(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_blocks_16bit_strided_and_batched(backend, block_gemm_level, dtype):
    backend("auto")
    w = quantize_int4(_weight(64, 128), 32)
    base = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(6)).to(dtype)
    x = base[..., :128]  # rows 256 apart: the kernel reads them in place
    out = int4_gemm(x, prepare_int4(w))
    assert out.shape == (2, 3, 64) and out.dtype == dtype
    torch.testing.assert_close(out.float(), int4_q8_gemm_ref(x, w).float(), rtol=1e-2,
                               atol=1e-2)


def test_reference_backend_keeps_the_layout(backend):
    backend("reference")
    w = quantize_int4(_weight(16, 64), 32)
    assert prepare_int4(w) is w
    x = torch.randn(2, 64)
    torch.testing.assert_close(int4_gemm(x, w), x @ dequantize_int4(w).t())
