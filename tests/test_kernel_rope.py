"""Fused RoPE + KV-cache write (pipellm/kernels/rope.py): the Triton path against the PyTorch
reference.

On a machine without a GPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py).
Known interpreter limitation: its float32 -> bfloat16 casts truncate (round toward zero) where
the GPU rounds to nearest even; the half-precision bound below allows for it.
"""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.kv_quant import KV_GROUP
from pipellm.kernels.rope import rope_kv_write, rope_kv_write_ref, rope_kv_write_triton
from pipellm.services.compute.model.rope import RotaryEmbedding, inv_frequencies

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MAX_POS = 16384
CAPACITY = 120


@pytest.fixture
def backend():
    """Lets a test switch pipellm.kernels.dispatch's backend; restores the previous one
    afterwards."""
    previous = dispatch.backend()
    yield dispatch.set_backend
    dispatch.set_backend(previous)


def _case(T, H, hkv, D, dtype, scaling=LLAMA3, seed=0, index_dtype=torch.int64, device="cpu"):
    """q, k, v as views of one fused qkv [T, (H + 2 Hkv) D], tables, random caches and slots."""
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(D, MAX_POS, 500000.0, scaling, torch.device(device))
    qkv = (torch.randn(T, (H + 2 * hkv) * D, generator=g) + 0.05).to(device=device, dtype=dtype)
    q, k, v = qkv.split([H * D, hkv * D, hkv * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, hkv, D), v.view(T, hkv, D)  # strided views
    positions = torch.randint(0, MAX_POS, (T,), generator=g).to(device=device, dtype=index_dtype)
    capacity = max(CAPACITY, 2 * T)
    slots = torch.randperm(capacity, generator=g)[:T].to(device=device, dtype=index_dtype)
    cache = torch.randn(2, capacity, hkv, D, generator=g).to(device=device, dtype=dtype)
    return dict(q=q, k=k, v=v, positions=positions, cos=rope.cos, sin=rope.sin,
                k_cache=cache[0], v_cache=cache[1], slots=slots), rope


def _run(fn, args):
    """fn on a copy of the caches: -> (q_rot, k_rot, k_cache, v_cache)."""
    args = dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
    return (*fn(**args), args["k_cache"], args["v_cache"])


def _half_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |kernel - reference| for x [T, h, D] in fp16/bf16.

    Reference: products and the sum each round (<= eps/2 relative each); kernel: one final
    rounding; the interpreter truncates bf16 (eps instead of eps/2, also on the cos/sin cast).
    All of it is below 3 eps (|x1| + |x2|) since |cos|, |sin| <= 1.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    a = 3 * torch.finfo(x.dtype).eps * (x1.abs() + x2.abs())  # [T, h, D/2]
    return torch.cat((a, a), dim=-1)


def test_reference_is_rotary_embedding_and_kv_write():
    args, rope = _case(37, 6, 2, 96, torch.bfloat16)
    q_rot, k_rot, kc, vc = _run(rope_kv_write_ref, args)
    assert torch.equal(q_rot, rope(args["q"], args["positions"]))
    assert torch.equal(k_rot, rope(args["k"], args["positions"]))
    expect_k, expect_v = args["k_cache"].clone(), args["v_cache"].clone()
    expect_k[args["slots"]] = k_rot
    expect_v[args["slots"]] = args["v"]
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


@pytest.mark.parametrize("T,H,hkv,D", [(1, 4, 2, 64), (37, 6, 2, 96), (37, 8, 8, 128)])
@pytest.mark.parametrize("scaling", [LLAMA3, None], ids=["llama3", "plain"])
def test_fp32_bit_exact(T, H, hkv, D, scaling):
    args, _ = _case(T, H, hkv, D, torch.float32, scaling)
    got, want = _run(rope_kv_write_triton, args), _run(rope_kv_write_ref, args)
    for name, a, b in zip(("q_rot", "k_rot", "k_cache", "v_cache"), got, want, strict=True):
        assert torch.equal(a, b), name
    # Only the written slots changed.
    untouched = torch.ones(args["k_cache"].shape[0], dtype=torch.bool)
    untouched[args["slots"]] = False
    assert torch.equal(got[2][untouched], args["k_cache"][untouched])
    assert torch.equal(got[3][untouched], args["v_cache"][untouched])


def test_int32_indices_and_linear_scaling():
    scaling = {"rope_type": "linear", "factor": 4.0}
    args, _ = _case(37, 4, 1, 64, torch.float32, scaling, seed=3, index_dtype=torch.int32)
    got = _run(rope_kv_write_triton, args)
    want = _run(rope_kv_write_ref, dict(args, positions=args["positions"].long(),
                                        slots=args["slots"].long()))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_llama3_tables_differ_from_plain():
    """The scaled tables really are scaled (guards the llama3 cases against a no-op)."""
    assert not torch.equal(inv_frequencies(128, 500000.0, LLAMA3),
                           inv_frequencies(128, 500000.0, None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,H,hkv,D", [(1, 4, 2, 64), (37, 6, 2, 96)])
def test_half_dtypes(dtype, T, H, hkv, D):
    args, _ = _case(T, H, hkv, D, dtype)
    q_rot, k_rot, kc, vc = _run(rope_kv_write_triton, args)
    rq, rk, rkc, rvc = _run(rope_kv_write_ref, args)
    assert q_rot.dtype == dtype and k_rot.dtype == dtype
    assert ((q_rot.float() - rq.float()).abs() <= _half_bound(args["q"])).all()
    assert ((k_rot.float() - rk.float()).abs() <= _half_bound(args["k"])).all()
    slots = args["slots"]
    assert torch.equal(kc[slots], k_rot)  # the cache holds exactly the returned k_rot
    assert torch.equal(vc, rvc)  # v is copied bit-for-bit
    untouched = torch.ones(kc.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(kc[untouched], rkc[untouched])


def test_dispatch(backend):
    args, _ = _case(5, 4, 2, 64, torch.float32)
    backend("reference")
    ref = _run(rope_kv_write, args)
    backend("triton")
    tri = _run(rope_kv_write, args)
    for a, b in zip(ref, tri, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,H,hkv,D", [(1, 32, 8, 128), (4099, 32, 8, 128), (777, 40, 8, 96)])
def test_gpu_large(dtype, T, H, hkv, D):
    args, _ = _case(T, H, hkv, D, dtype, device="cuda")
    assert dispatch.use_triton(args["q"])
    q_rot, k_rot, kc, vc = _run(rope_kv_write, args)
    rq, rk, rkc, rvc = _run(rope_kv_write_ref, args)
    if dtype == torch.float32:  # same roundings, no FMA (enable_fp_fusion=False)
        assert torch.equal(q_rot, rq) and torch.equal(k_rot, rk)
    else:
        assert ((q_rot.float() - rq.float()).abs() <= _half_bound(args["q"])).all()
        assert ((k_rot.float() - rk.float()).abs() <= _half_bound(args["k"])).all()
    assert torch.equal(kc[args["slots"]], k_rot)
    assert torch.equal(vc, rvc)


@pytest.mark.parametrize("T,H,hkv,D", [(5, 4, 2, 64), (3, 6, 3, 32), (2, 8, 1, 128)])
def test_int8_write_matches_the_reference(T, H, hkv, D):
    """INT8 caches: the Triton kernel quantizes the rows it writes (fused) as the reference
    does: the same scales, values at most one step apart (a division's last bit), only the
    written slots touched."""
    args, _ = _case(T, H, hkv, D, torch.float32, seed=D)
    cap = args["k_cache"].shape[0]
    out = {}
    for name, fn in (("triton", rope_kv_write_triton), ("ref", rope_kv_write_ref)):
        caches = [torch.zeros(cap, hkv, D, dtype=torch.int8) for _ in range(2)]
        scales = [torch.zeros(cap, hkv, D // KV_GROUP, dtype=torch.float16) for _ in range(2)]
        q_rot, k_rot = fn(**dict(args, k_cache=caches[0], v_cache=caches[1]), k_scale=scales[0],
                          v_scale=scales[1])
        out[name] = (q_rot, k_rot, *caches, *scales)
    got, want = out["triton"], out["ref"]
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for g, w in zip(got[2:4], want[2:4], strict=True):
        assert (g.int() - w.int()).abs().max() <= 1
    for g, w in zip(got[4:], want[4:], strict=True):
        assert torch.equal(g, w)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[args["slots"]] = False
    assert got[2][untouched].eq(0).all() and got[4][untouched].eq(0).all()
    assert got[2][args["slots"]].ne(0).any()
