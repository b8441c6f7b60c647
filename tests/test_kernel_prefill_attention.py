"""Prefill attention: the Triton kernel (interpreted on CPU) against the PyTorch reference, and
the reference against a dense causal softmax and against SDPA(is_causal=True)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipellm.kernels import dispatch
from pipellm.kernels.kv_quant import FP8, dequantize_kv, quantize_kv, to_fp8
from pipellm.kernels.prefill_attention import (
    _prefill_attention_cpu,
    _prefill_attention_triton,
    prefill_attention,
    prefill_attention_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Chunked prefill in one launch: a decode-like 1-token chunk over a 200-token prefix, a 5-token
# chunk over 13 cached tokens, a 70-token fresh prompt (KV lengths 201, 18, 70).
Q_LENS, PREFIXES = (1, 5, 70), (200, 13, 0)  # check_triton defaults to max_q_len=70
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# the vector kernel has an AVX2 and an AVX-512 variant (block_gemm_level: the ones a CPU runs)
VECTOR_LEVELS = pytest.mark.parametrize("block_gemm_level", ["avx2", "avx512"], indirect=True)


pytestmark = pytest.mark.usefixtures("interpreter_bf16_dot")


@pytest.fixture
def triton_backend():
    """Route the public function to the Triton kernel for the test, whatever the device."""
    before = dispatch.backend()
    dispatch.set_backend("triton")
    yield
    dispatch.set_backend(before)


def make_batch(q_lens, prefixes, n_heads, n_kv_heads, head_dim, dtype, *, garbage="randn",
               seed=0, device=DEVICE):
    """Random queries and a KV cache holding each sequence's segment at scattered offsets.

    Returns q [T, H, D], k, v [capacity, Hkv, D], cu_q_lens [S+1], seq_starts [S], ctx_lens [S]
    (int32). Unused slots hold large random values (garbage="randn") or NaN (garbage="nan").
    """
    g = torch.Generator().manual_seed(seed)
    ctx = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
    gaps = torch.randint(3, 40, (len(ctx) + 1,), generator=g).tolist()  # [S+1] unused slots
    capacity = sum(ctx) + sum(gaps)
    shape = (capacity, n_kv_heads, head_dim)
    if garbage == "nan":
        k, v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    else:
        k, v = 1e3 * torch.randn(shape, generator=g), 1e3 * torch.randn(shape, generator=g)
    starts, slot = [0] * len(ctx), gaps[0]
    for i, s in enumerate(torch.randperm(len(ctx), generator=g).tolist()):  # shuffled order
        starts[s] = slot
        k[slot : slot + ctx[s]] = torch.randn((ctx[s], n_kv_heads, head_dim), generator=g)
        v[slot : slot + ctx[s]] = torch.randn((ctx[s], n_kv_heads, head_dim), generator=g)
        slot += ctx[s] + gaps[i + 1]
    q = torch.randn((sum(q_lens), n_heads, head_dim), generator=g)
    cu = [0, *np.cumsum(q_lens).tolist()]
    ints = [torch.tensor(x, dtype=torch.int32, device=device) for x in (cu, starts, ctx)]
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), *ints)


def dense_attention(q, k, v, cu_q_lens, seq_starts, ctx_lens, scale, window=0, softcap=0.0):
    """Explicit float64 softmax(q k^T * scale + causal mask) v, one sequence at a time; window
    > 0: the query at position p also hides the keys at positions <= p - window; softcap > 0:
    scores s become softcap * tanh(s / softcap) before the mask (Gemma 2's eager attention)."""
    group = q.shape[1] // k.shape[1]
    cu, starts, ctx = cu_q_lens.tolist(), seq_starts.tolist(), ctx_lens.tolist()
    outs = []
    for s, (start, n) in enumerate(zip(starts, ctx, strict=True)):
        qs = q[cu[s] : cu[s + 1]].double()  # [L, H, D]
        ks = k[start : start + n].double().repeat_interleave(group, dim=1)  # [n, H, D]
        vs = v[start : start + n].double().repeat_interleave(group, dim=1)  # [n, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # [H, L, n]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(n - qs.shape[0], n, device=q.device)[:, None]  # [L, 1]
        visible = torch.arange(n, device=q.device)[None, :] <= pos  # [L, n]
        if window:
            visible &= torch.arange(n, device=q.device)[None, :] > pos - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))  # [L, H, D]
    return torch.cat(outs)


def check_triton(batch, scale, block_m=None, block_n=None, max_q_len=70, window=0, kv=None):
    """Run the kernel on `batch` (with `kv`: on those (k, v) instead) and compare it with the
    fp32 reference on the batch's inputs."""
    q, k, v, cu, starts, ctx = batch
    kk, vv = kv or (k, v)
    out = _prefill_attention_triton(q, kk, vv, cu, starts, ctx, scale, max_q_len, block_m,
                                    block_n, window=window)
    ref = prefill_attention_reference(q.float(), k.float(), v.float(), cu, starts, ctx, scale,
                                      window)
    assert out.dtype == q.dtype and out.shape == q.shape
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(2, 2), (4, 1)])
def test_reference_matches_dense_softmax(n_heads, n_kv_heads):
    batch = make_batch(Q_LENS, PREFIXES, n_heads, n_kv_heads, 64, torch.float32)
    out = prefill_attention_reference(*batch, 0.1)
    torch.testing.assert_close(out.double(), dense_attention(*batch, 0.1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_dense_softmax(n_heads, n_kv_heads, dtype):
    """The CPU implementation `prefill_attention` runs under --kernels auto: chunks with and
    without a cached prefix, GQA, a sequence with no new tokens this step."""
    batch = make_batch((1, 5, 0, 70), (200, 13, 7, 0), n_heads, n_kv_heads, 64, dtype)
    assert dispatch.cpu_fast_path(batch[0])
    out = prefill_attention(*batch, 0.1)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), dense_attention(*batch, 0.1), atol=tol, rtol=tol)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 0.0), (0, 5.0), (150, 5.0)])
def test_cpu_path_blocks_of_queries_match_dense_softmax(window, softcap):
    """Chunks longer than QUERY_BLOCK (each block scores only the keys it sees): a fresh
    300-token prompt, a 150-token chunk over a 90-token prefix, a decode-like token; with and
    without a window and a softcap."""
    from pipellm.kernels.prefill_attention import QUERY_BLOCK

    batch = make_batch((300, 150, 1), (0, 90, 200), 6, 2, 64, torch.float32, seed=3)
    assert dispatch.cpu_fast_path(batch[0]) and 300 > 2 * QUERY_BLOCK
    out = prefill_attention(*batch, 0.1, window=window, softcap=softcap)
    exp = dense_attention(*batch, 0.1, window, softcap)
    torch.testing.assert_close(out.double(), exp, atol=1e-5, rtol=1e-5)


def test_reference_matches_sdpa_causal():
    """With no cached prefix (q_len == ctx_len) the mask is the plain causal one."""
    q, k, v, cu, starts, ctx = make_batch((9, 33, 1), (0, 0, 0), 4, 2, 64, torch.float32)
    out = prefill_attention_reference(q, k, v, cu, starts, ctx, 64**-0.5)
    for s in range(3):
        q0, q1, st = cu[s].item(), cu[s + 1].item(), starts[s].item()
        ks = k[st : st + q1 - q0].repeat_interleave(2, dim=1).transpose(0, 1)  # [H, L, D]
        vs = v[st : st + q1 - q0].repeat_interleave(2, dim=1).transpose(0, 1)  # [H, L, D]
        exp = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), ks, vs, is_causal=True)
        torch.testing.assert_close(out[q0:q1], exp.transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(2, 2), (4, 1), (8, 1)])
def test_triton_matches_reference_fp32(n_heads, n_kv_heads, head_dim):
    batch = make_batch(Q_LENS, PREFIXES, n_heads, n_kv_heads, head_dim, torch.float32)
    check_triton(batch, head_dim**-0.5, 16, 16)


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32), (64, 64), (None, None)])
def test_triton_block_shapes(block_m, block_n):
    """Diagonal handling when BLOCK_M != BLOCK_N, and the static (H100) default config."""
    batch = make_batch(Q_LENS, PREFIXES, 4, 2, 64, torch.float16, seed=1)
    check_triton(batch, 0.125, block_m, block_n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,n_kv_heads", [(64, 1), (128, 2)])
def test_triton_half_precision(dtype, head_dim, n_kv_heads):
    batch = make_batch(Q_LENS, PREFIXES, 4, n_kv_heads, head_dim, dtype, seed=2)
    check_triton(batch, head_dim**-0.5, 16, 16)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32)])
def test_triton_diagonal_alignments(block_m, block_n):
    """Prefixes of every residue mod BLOCK_N: the unmasked/masked split must never let a query
    see a later key. max_q_len is an over-estimate (the extra tiles must do nothing)."""
    prefixes = list(range(block_n + 2))
    q_lens = [1 + (7 * i) % 23 for i in prefixes]  # 1..23: one or two query tiles
    batch = make_batch(q_lens, prefixes, 2, 1, 64, torch.float32, seed=5)
    check_triton(batch, 0.125, block_m, block_n, max_q_len=64)


def test_triton_reads_only_its_segments():
    """NaN in every unused cache slot: reading any of them (even masked) would poison the output."""
    batch = make_batch(Q_LENS, PREFIXES, 4, 1, 64, torch.float32, garbage="nan", seed=3)
    check_triton(batch, 0.125, 16, 16)


def test_public_function_dispatch(triton_backend):
    """Default scale, the max_q_len hint (and the .item() fallback), a strided q (a view into a
    fused qkv tensor), an empty chunk in the batch; the reference backend gives the same."""
    q_lens, prefixes = (3, 0, 20), (7, 5, 11)
    q, k, v, cu, starts, ctx = make_batch(q_lens, prefixes, 4, 2, 64, torch.float32, seed=4)
    qkv = torch.randn(q.shape[0], 8, 64, device=q.device)  # [T, H + 2 Hkv, D]
    qkv[:, :4] = q
    q = qkv[:, :4]  # [T, H, D], token stride 8 * 64
    exp = dense_attention(q, k, v, cu, starts, ctx, 64**-0.5)
    out = prefill_attention(q, k, v, cu, starts, ctx, max_q_len=20)
    torch.testing.assert_close(out.double(), exp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefill_attention(q, k, v, cu, starts, ctx), out)
    dispatch.set_backend("reference")
    ref = prefill_attention(q, k, v, cu, starts, ctx)
    torch.testing.assert_close(ref.double(), exp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_int8_kv_like_the_reference(n_heads, n_kv_heads, dtype):
    """INT8 caches (pipellm/kernels/kv_quant.py) dequantized in registers, masked and unmasked
    blocks: the kernel against the reference on the dequantized cache."""
    q, k, v, cu, starts, ctx = make_batch(Q_LENS, PREFIXES, n_heads, n_kv_heads, 64, dtype)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    out = _prefill_attention_triton(q, kq, vq, cu, starts, ctx, 0.1, 70, 16, 16,
                                    k_scale=ks, v_scale=vs)
    ref = prefill_attention_reference(q.float(), dequantize_kv(kq, ks), dequantize_kv(vq, vs),
                                      cu, starts, ctx, 0.1)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_rejects_bad_head_dim():
    q, k, v, cu, starts, ctx = make_batch((4,), (0,), 2, 2, 48, torch.float32)
    with pytest.raises(AssertionError, match="power of 2"):
        _prefill_attention_triton(q, k, v, cu, starts, ctx, 0.1, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(32, 8, 128), (16, 16, 64), (32, 4, 64)])
def test_triton_large_gpu(dtype, n_heads, n_kv_heads, head_dim, triton_backend):
    """Production-sized shapes with the default configs, through the public function."""
    q_lens, prefixes = (1, 517, 2048, 77, 1024), (4000, 0, 0, 3071, 513)
    q, k, v, cu, starts, ctx = make_batch(q_lens, prefixes, n_heads, n_kv_heads, head_dim, dtype)
    out = prefill_attention(q, k, v, cu, starts, ctx, max_q_len=max(q_lens))
    ref = prefill_attention_reference(q.float(), k.float(), v.float(), cu, starts, ctx,
                                      head_dim**-0.5)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# --- sliding window: the query at position p sees keys (p - window, p] ------------------------

WINDOWS = [1, 5, 16, 70, 201, 1000]  # KV lengths 201, 18, 70: smaller, equal, larger


def poison_unread(batch, window, block_n):
    """(k, v) with NaN in the rows of each sequence before the block holding its first query's
    first visible key: the Triton kernel must skip those blocks, never load them."""
    _, k, v, cu, starts, ctx = batch
    k, v = k.clone(), v.clone()
    for s, (start, n) in enumerate(zip(starts.tolist(), ctx.tolist(), strict=True)):
        first_pos = n - (cu[s + 1] - cu[s]).item()
        skip = max(0, first_pos - window + 1) // block_n * block_n
        k[start : start + skip] = float("nan")
        v[start : start + skip] = float("nan")
    return k, v


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_and_cpu_path_window_match_dense(window):
    """The reference and the CPU path (GEMMs over the keys some query sees) with a window;
    chunks with and without a cached prefix and an empty one."""
    batch = make_batch((1, 5, 0, 70), (200, 13, 7, 0), 6, 2, 64, torch.float32, seed=window)
    exp = dense_attention(*batch, 0.1, window)
    ref = prefill_attention_reference(*batch, 0.1, window)
    torch.testing.assert_close(ref.double(), exp, atol=1e-5, rtol=1e-5)
    assert dispatch.cpu_fast_path(batch[0])
    cpu = prefill_attention(*batch, 0.1, window=window)
    torch.testing.assert_close(cpu.double(), exp, atol=1e-5, rtol=1e-5)
    if window < 70:
        assert not torch.allclose(ref, prefill_attention_reference(*batch, 0.1))


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_window_matches_reference(window, block_m, block_n):
    """Left-edge, unmasked and diagonal blocks in every arrangement; the blocks wholly before
    the window hold NaN (never loaded)."""
    batch = make_batch(Q_LENS, PREFIXES, 4, 2, 64, torch.float32, seed=window)
    check_triton(batch, 0.125, block_m, block_n, window=window,
                 kv=poison_unread(batch, window, block_n))


@pytest.mark.parametrize("window", [3, 16, 17])
def test_triton_window_alignments(window):
    """Prefixes of every residue mod BLOCK_N and chunks of 1-23 queries under small windows."""
    prefixes = list(range(0, 50, 3))
    q_lens = [1 + (7 * i) % 23 for i in range(len(prefixes))]
    batch = make_batch(q_lens, prefixes, 2, 1, 64, torch.float32, seed=5)
    check_triton(batch, 0.125, 16, 16, max_q_len=64, window=window,
                 kv=poison_unread(batch, window, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [16, 201])
def test_triton_window_on_int8_kv(window, dtype):
    q, k, v, cu, starts, ctx = make_batch(Q_LENS, PREFIXES, 4, 1, 64, dtype, seed=8)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    out = _prefill_attention_triton(q, kq, vq, cu, starts, ctx, 0.1, 70, 16, 16,
                                    k_scale=ks, v_scale=vs, window=window)
    ref = prefill_attention_reference(q.float(), dequantize_kv(kq, ks), dequantize_kv(vq, vs),
                                      cu, starts, ctx, 0.1, window)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    cpu = prefill_attention(q.float(), kq, vq, cu, starts, ctx, 0.1, k_scale=ks, v_scale=vs,
                            window=window)  # off Triton: the CPU path dequantizes its rows
    torch.testing.assert_close(cpu, ref, atol=1e-5, rtol=1e-5)


def test_public_function_window_triton(triton_backend):
    batch = make_batch((3, 0, 40), (60, 5, 11), 4, 2, 64, torch.float32, seed=9)
    out = prefill_attention(*batch, 0.125, window=8)
    torch.testing.assert_close(out.double(), dense_attention(*batch, 0.125, 8), atol=1e-4,
                               rtol=1e-4)


# --- logit soft-capping (Gemma 2): scores s = scale * q.k -> softcap * tanh(s / softcap) ------


@pytest.mark.parametrize("window,int8", [(0, False), (16, False), (16, True)])
def test_softcap_every_path_matches_dense(window, int8):
    """The reference (explicit scores: SDPA cannot cap), the CPU GEMM path and the Triton kernel
    against a float64 eager softmax of capped scores; q is scaled so that most |scores| exceed
    the cap of 5."""
    q, k, v, cu, starts, ctx = make_batch(Q_LENS, PREFIXES, 4, 2, 64, torch.float32, seed=13)
    q = q * 4  # scores ~ N(0, 4^2): the cap matters
    kv, scales = (k, v), {}
    if int8:  # the kernels read the INT8 cache, the dense softmax its dequantized values
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        kv, scales = (kq, vq), dict(k_scale=ks, v_scale=vs)
        k, v = dequantize_kv(kq, ks), dequantize_kv(vq, vs)
    exp = dense_attention(q, k, v, cu, starts, ctx, 0.125, window, softcap=5.0)
    assert not torch.allclose(exp, dense_attention(q, k, v, cu, starts, ctx, 0.125, window),
                              atol=1e-2)  # the cap changes the output
    assert dispatch.cpu_fast_path(q)
    outs = {
        "reference": prefill_attention_reference(q, k, v, cu, starts, ctx, 0.125, window, 5.0),
        "cpu": prefill_attention(q, *kv, cu, starts, ctx, 0.125, **scales, window=window,
                                 softcap=5.0),
        "triton": _prefill_attention_triton(q, *kv, cu, starts, ctx, 0.125, 70, 16, 16,
                                            **scales, window=window, softcap=5.0),
    }
    for name, out in outs.items():
        torch.testing.assert_close(out.double(), exp, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _amx_extension():
    """The C++ module when its AMX prefill kernel runs on this CPU (the `amx` level), else a
    skip: pipellm/kernels/cpu/prefill_attention_amx.cpp needs the tiles."""
    from pipellm.kernels.cpu import extension, isa

    ext = extension()
    if ext is None or isa.selected() != "amx" or not ext.prefill_attention_amx_ready():
        pytest.skip(f"no AMX prefill kernel here ({isa.describe()})")
    return ext


@pytest.fixture(params=["tiles", "emulated"])
def amx_kernel(request):
    """A module whose prefill_attention runs the AMX kernel on bf16: the main one on this
    CPU's tiles, or pipellm/kernels/cpu/emulated.py's on emulated tiles (any CPU with AVX512-BF16),
    else a skip."""
    if request.param == "tiles":
        return _amx_extension()
    from pipellm.kernels.cpu import emulated, isa

    if not emulated.runnable():
        pytest.skip(f"the emulated AMX kernel needs AVX512-BF16 ({isa.describe()})")
    return emulated.module()


def _amx_batch(n_heads, n_kv_heads, head_dim):
    """Fresh prompts across several 64-key groups (300, 70), chunks over a cached prefix (150
    over 90, 5 over 13), a decode-like token over 200, a sequence with no new token; NaN in
    every slot outside the segments (never read)."""
    return make_batch((300, 150, 1, 5, 0, 70), (0, 90, 200, 13, 7, 0), n_heads, n_kv_heads,
                      head_dim, torch.bfloat16, garbage="nan", seed=5)


AMX_HEADS = pytest.mark.parametrize("n_heads,n_kv_heads,head_dim",
                                    [(6, 2, 64), (9, 3, 64), (4, 4, 128)])


@AMX_HEADS
def test_amx_kernel_matches_dense_softmax(amx_kernel, n_heads, n_kv_heads, head_dim):
    """bf16 on AMX tiles, P in two bf16 parts: as close to a float64 softmax as the float32
    GEMMs are."""
    batch = _amx_batch(n_heads, n_kv_heads, head_dim)
    out = amx_kernel.prefill_attention(*batch, 0.1)
    assert out.dtype == torch.bfloat16 and out.shape == batch[0].shape
    exp = dense_attention(*batch, 0.1)
    torch.testing.assert_close(out.double(), exp, atol=2e-2, rtol=2e-2)
    gemm_err = (_prefill_attention_cpu(*batch, 0.1).double() - exp).abs().max()
    assert (out.double() - exp).abs().max() <= 1.5 * gemm_err  # as close as the float32 GEMMs


@AMX_HEADS
def test_amx_kernel_coarse_p(amx_kernel, n_heads, n_kv_heads, head_dim):
    """With coarse_p (a pooling forward's), P rounded to bf16 alone: another result than the
    two parts' (the second product is gone), still within bf16's reach of a float64
    softmax."""
    batch = _amx_batch(n_heads, n_kv_heads, head_dim)
    fine = amx_kernel.prefill_attention(*batch, 0.1)
    coarse = amx_kernel.prefill_attention(*batch, 0.1, coarse_p=True)
    assert not torch.equal(coarse, fine)
    exp = dense_attention(*batch, 0.1)
    gemm_err = (_prefill_attention_cpu(*batch, 0.1).double() - exp).abs().max()
    assert (coarse.double() - exp).abs().max() <= 2 * gemm_err
    assert (coarse.double() - fine.double()).abs().mean() < 1e-3


def test_public_function_runs_the_amx_kernel():
    """At the amx level, the public function sends bf16 to the AMX kernel, coarse_p with it."""
    from pipellm.kernels.prefill_attention import _kernel_takes

    ext = _amx_extension()
    batch = _amx_batch(9, 3, 64)
    assert _kernel_takes(*batch[:3], None, 0, 0.0)
    for coarse in (False, True):
        assert torch.equal(prefill_attention(*batch, 0.1, coarse_p=coarse),
                           ext.prefill_attention(*batch, 0.1, coarse_p=coarse))


@VECTOR_LEVELS
def test_vector_kernel_ignores_coarse_p(block_gemm_level):
    """The float32 kernels keep P in float32 whatever coarse_p says (float16: never a bf16
    kernel's)."""
    from pipellm.kernels.cpu import extension

    batch = make_batch((300, 5, 70), (0, 13, 0), 9, 3, 64, torch.float16, seed=6)
    ext = extension()
    assert torch.equal(ext.prefill_attention(*batch, 0.1, coarse_p=True),
                       ext.prefill_attention(*batch, 0.1))


@pytest.mark.parametrize("block_gemm_level", ["avx512", "avx512_vnni"], indirect=True)
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(9, 3, 64), (6, 2, 96), (4, 2, 16)])
@pytest.mark.parametrize("window", [0, 50])
def test_bf16_products_match_dense_softmax(block_gemm_level, n_heads, n_kv_heads, head_dim,
                                           window):
    """bf16 with coarse_p (a pooling forward's) at the AVX-512 levels, on a CPU with
    AVX512-BF16 (without AMX tiles, or where they do not apply): bf16 pair products and P in
    bf16, within twice the float32 GEMMs' distance of a float64 softmax; not the float32
    products that run without coarse_p."""
    from pipellm.kernels.cpu import extension, isa

    if "avx512_bf16" not in isa.cpu_flags():
        pytest.skip(f"this CPU has no AVX512-BF16 ({isa.describe()})")
    ext = extension()
    batch = make_batch((300, 150, 1, 5, 0, 70), (0, 90, 200, 13, 7, 0), n_heads, n_kv_heads,
                       head_dim, torch.bfloat16, garbage="nan", seed=5)
    fine = ext.prefill_attention(*batch, 0.1, window)
    coarse = ext.prefill_attention(*batch, 0.1, window, coarse_p=True)
    exp = dense_attention(*batch, 0.1, window=window)
    gemm_err = (_prefill_attention_cpu(*batch, 0.1, window=window).double() - exp).abs().max()
    assert (coarse.double() - exp).abs().max() <= 2 * gemm_err
    assert not torch.equal(coarse, fine)
    assert torch.equal(prefill_attention(*batch, 0.1, window=window, coarse_p=True), coarse)


@VECTOR_LEVELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim",
                         [(9, 3, 64), (4, 4, 128), (6, 2, 96), (4, 2, 16)])
def test_cpu_kernel_at_each_level_matches_dense_softmax(block_gemm_level, dtype, n_heads,
                                                        n_kv_heads, head_dim):
    """pipellm/kernels/cpu/prefill_attention.cpp at each ISA level this CPU runs (float32 vectors of
    8 or 16; bf16 with head_dim 64 or 128 on an AMX CPU: its tiles), the batch of the AMX test
    (NaN outside the segments); head_dim 96 and 16 leave vectors past the micro-kernel's width.
    As close to the float64 dense softmax as the float32-GEMM path is."""
    from pipellm.kernels.cpu import extension

    batch = make_batch((300, 150, 1, 5, 0, 70), (0, 90, 200, 13, 7, 0), n_heads, n_kv_heads,
                       head_dim, dtype, garbage="nan", seed=5)
    out = extension().prefill_attention(*batch, 0.1)
    assert out.dtype == dtype and out.shape == batch[0].shape
    exp = dense_attention(*batch, 0.1)
    torch.testing.assert_close(out.double(), exp, atol=TOL[dtype], rtol=TOL[dtype])
    gemm_err = (_prefill_attention_cpu(*batch, 0.1).double() - exp).abs().max()
    assert (out.double() - exp).abs().max() <= 2 * gemm_err + 1e-6


@VECTOR_LEVELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 64, 100, 500])
def test_cpu_kernel_window_at_each_level_matches_dense(block_gemm_level, dtype, window):
    """A sliding window in the C++ kernel's float32 vectors (bf16 too: AMX tiles take no
    window): windows shorter than a block of queries, than a score pass, across the cached
    prefix, and past every sequence's length; the public function runs it."""
    from pipellm.kernels.cpu import extension

    batch = make_batch((300, 150, 1, 5, 70), (0, 90, 200, 13, 0), 6, 2, 64, dtype,
                       garbage="nan", seed=6)
    out = extension().prefill_attention(*batch, 0.1, window)
    assert torch.equal(prefill_attention(*batch, 0.1, window=window), out)
    exp = dense_attention(*batch, 0.1, window=window)
    torch.testing.assert_close(out.double(), exp, atol=TOL[dtype], rtol=TOL[dtype])
    gemm_err = (_prefill_attention_cpu(*batch, 0.1, window=window).double() - exp).abs().max()
    assert (out.double() - exp).abs().max() <= 2 * gemm_err + 1e-6


@VECTOR_LEVELS
@pytest.mark.parametrize("dtype,cache", [
    (torch.float32, "int8"), (torch.float32, "fp8"), (torch.float32, "float16"),
    (torch.bfloat16, "int8"), (torch.bfloat16, "fp8")])
@pytest.mark.parametrize("window", [0, 64])
def test_cpu_kernel_quantized_caches_at_each_level(block_gemm_level, dtype, cache, window):
    """INT8 caches (fp16 scales per 8 values), FP8 ones and fp16 ones under float32 queries,
    converted as the C++ kernel packs them, at each ISA level: as close to the float64 dense
    softmax over the caches' values as the float32-GEMM path; the public function runs it."""
    from pipellm.kernels.cpu import extension

    q, k, v, cu, starts, ctx = make_batch((300, 150, 1, 5, 70), (0, 90, 200, 13, 0), 6, 2, 64,
                                          torch.float32, seed=7)
    q = q.to(dtype)
    if cache == "int8":
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        kd, vd = dequantize_kv(kq, ks), dequantize_kv(vq, vs)
    else:
        kq, vq = (to_fp8(k), to_fp8(v)) if cache == "fp8" else (k.half(), v.half())
        kd, vd, ks, vs = kq.float(), vq.float(), None, None
    args = (q, kq, vq, cu, starts, ctx, 0.1)
    out = extension().prefill_attention(*args, window, ks, vs)
    assert out.dtype == dtype
    assert torch.equal(prefill_attention(*args, k_scale=ks, v_scale=vs, window=window), out)
    exp = dense_attention(q, kd, vd, cu, starts, ctx, 0.1, window=window)
    torch.testing.assert_close(out.double(), exp, atol=TOL[dtype], rtol=TOL[dtype])
    gemm = _prefill_attention_cpu(*args, k_scale=ks, v_scale=vs, window=window)
    assert (out.double() - exp).abs().max() <= 2 * (gemm.double() - exp).abs().max() + 1e-6


def test_cpu_kernel_takes_only_its_cases():
    """The public function runs the C++ kernel wherever the C++ kernels run, for float32, bf16
    and float16 queries over caches of their dtype (or fp16 under float32), INT8 with scales or
    FP8, without a softcap, head_dim a multiple of 16; the rest goes to the GEMM path."""
    from pipellm.kernels.cpu import extension
    from pipellm.kernels.prefill_attention import _kernel_takes

    ext = extension()
    if ext is None or not ext.block_gemm_isa():
        pytest.skip("the C++ kernels do not run here (python -m pipellm.kernels.cpu says why)")
    batch = make_batch((40, 3), (0, 9), 4, 2, 64, torch.float32, seed=3)
    q, k, v, *_ = batch
    assert _kernel_takes(q, k, v, None, 0, 0.0)
    assert torch.equal(prefill_attention(*batch, 0.1), ext.prefill_attention(*batch, 0.1))
    assert _kernel_takes(q, k, v, None, 16, 0.0) and not _kernel_takes(q, k, v, None, 0, 5.0)
    (kq, ks), (vq, _) = quantize_kv(k), quantize_kv(v)
    assert _kernel_takes(q, kq, vq, ks, 0, 0.0) and _kernel_takes(q, k.to(FP8), v.to(FP8), None,
                                                                  0, 0.0)
    assert not _kernel_takes(q, k, v, torch.ones(1), 0, 0.0)  # scales for a float cache
    assert not _kernel_takes(q, kq, vq, None, 0, 0.0)  # INT8 without its scales
    assert not _kernel_takes(q.bfloat16(), k, v, None, 0, 0.0)
    assert _kernel_takes(q, k.half(), v.half(), None, 0, 0.0)  # fp16 under float32 q
    assert not _kernel_takes(q.bfloat16(), k.half(), v.half(), None, 0, 0.0)
    q24, k24, v24, *_ = make_batch((5,), (3,), 4, 2, 24, torch.float32)
    assert not _kernel_takes(q24, k24, v24, None, 0, 0.0)


def test_cpu_gemm_path_bf16_matches_dense_softmax():
    """The float32-GEMM CPU path on bf16 inputs, whichever the machine's level (on an AMX CPU
    the public function sends bf16 to the AMX kernel instead)."""
    batch = make_batch((300, 1, 70), (0, 200, 0), 6, 2, 64, torch.bfloat16, seed=2)
    out = _prefill_attention_cpu(*batch, 0.1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_attention(*batch, 0.1), atol=2e-2, rtol=2e-2)
