"""INT4 weights in tinygemm's tile layout (pipellm/kernels/int4_tiles.py): the permutation and its
inverse, and on a GPU torch's packing, tinygemm, and the few-row dispatch against the
references."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.int4_gemm import Int4Cuda, int4_gemm, int4_gemm_ref, prepare_int4
from pipellm.kernels.int4_tiles import (
    Int4Tiles,
    dequantize_tiles_ref,
    inner_k_tiles,
    int4_tiles_gemm,
    pack_tiles,
    pack_tiles_ref,
    tiles_fit,
)
from pipellm.kernels.int4_weight import Int4Weight, quantize_int4, scales_zeros


def _int4(n, k, group, seed=0, device="cpu") -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01
    return quantize_int4(w, group).to(device, torch.bfloat16)


def _tiles_ref(w: Int4Weight) -> Int4Tiles:
    return Int4Tiles(pack_tiles_ref(w), scales_zeros(w), w.group_size)


def _tinygemm_weight(w: Int4Weight) -> torch.Tensor:
    """What the tiles stand for: tinygemm's (q - 8) scale + zero with bf16 scale and zero."""
    q = torch.stack([w.packed & 0xF, w.packed >> 4], -1).view(w.shape).float()
    sz = scales_zeros(w).float().repeat_interleave(w.group_size, 0)
    return (q - 8) * sz[..., 0].t() + sz[..., 1].t()


@pytest.mark.parametrize("n,k,group", [(16, 128, 32), (24, 64, 64), (8, 96, 32), (40, 256, 128)])
def test_tiles_round_trip_to_the_weight(n, k, group):
    w = _int4(n, k, group)
    t = _tiles_ref(w)
    i = inner_k_tiles(k)
    assert t.tiles.shape == (n // 8, k // (16 * i), 32, i // 2) and t.tiles.dtype == torch.int32
    assert t.inner_k_tiles == i and t.shape == (n, k)
    torch.testing.assert_close(dequantize_tiles_ref(t), _tinygemm_weight(w), rtol=0, atol=0)
    # and close to the Int4Weight's own values (bf16 rounding of zero = min + 8 scale only)
    from pipellm.kernels.int4_weight import dequantize_int4
    assert (dequantize_tiles_ref(t) - dequantize_int4(w)).abs().max() < 2e-3


def test_one_value_lies_where_the_layout_says():
    """k = ((ko I / 2 + w) 2 + s) 16 + (h 4 + c) 2 + e -> word [n // 8, ko, (n % 8) 4 + c, w],
    bit 4 (2 s + h) + 16 e (module docstring), for one hand-picked (n, k)."""
    n, k = 16, 256
    w = _int4(n, k, 32)
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[13, 173] = 11  # ko 1, w 1, s 0, h 1, c 2, e 1 (I = 8: 128 k per outer tile)
    w = Int4Weight(q[:, 0::2] | (q[:, 1::2] << 4), w.scales, w.mins, 32)
    words = pack_tiles_ref(w)
    assert int(words[1, 1, 5 * 4 + 2, 1]) == 11 << (4 * (2 * 0 + 1) + 16)
    assert int((words != 0).sum()) == 1


def test_tiles_fit():
    assert tiles_fit(4096, 4096, 128, torch.bfloat16)
    assert not tiles_fit(4096, 4096, 128, torch.float16)  # tinygemm takes bf16 only
    assert not tiles_fit(4100, 4096, 128, torch.bfloat16)  # N % 8
    assert not tiles_fit(64, 80, 16, torch.bfloat16)  # K % 32, group
    assert inner_k_tiles(4096) == 8 and inner_k_tiles(96) == 2 and inner_k_tiles(48) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (256, 96, 32), (1024, 512, 64)])
def test_torch_packs_as_the_layout_says(n, k, group):
    w = _int4(n, k, group, device="cuda")
    assert torch.equal(pack_tiles(w).tiles, pack_tiles_ref(w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16])
def test_tinygemm_matches_the_reference(m):
    w = _int4(1024, 512, 64, seed=5, device="cuda")
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    want = (x.float() @ _tinygemm_weight(w).t() + bias.float())
    got = int4_tiles_gemm(x, pack_tiles(w), bias).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512,), (1, 512), (1, 1, 512), (3, 512), (40, 512)])
def test_prepare_int4_keeps_tiles_beside_the_weight_for_few_rows(shape):
    """bf16 on CUDA: Int4Cuda; up to TINYGEMM_ROWS rows run tinygemm, more the Triton path;
    both give the reference's output. fp16 keeps the Int4Weight (tinygemm takes bf16 only)."""
    assert dispatch.backend() == "auto"
    w = _int4(256, 512, 32, seed=2, device="cuda")
    prepared = prepare_int4(w)
    assert isinstance(prepared, Int4Cuda) and prepared.weight is w
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    out = int4_gemm(x, prepared)
    assert out.shape == (*shape[:-1], 256)
    torch.testing.assert_close(out, int4_gemm_ref(x, w), rtol=3e-2, atol=3e-2)
    fp16 = quantize_int4(torch.randn(64, 128), 32).to("cuda", torch.float16)
    assert isinstance(prepare_int4(fp16), Int4Weight)
