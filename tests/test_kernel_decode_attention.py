"""Decode attention: the Triton flash-decoding kernel (interpreter on CPU) vs the PyTorch reference,
and the reference vs a dense masked softmax."""

from __future__ import annotations

import importlib

import pytest
import torch

from pipellm.kernels import arrivals, dispatch
from pipellm.kernels.cpu import extension as cpu_extension
from pipellm.kernels.decode_attention import (
    TILINGS,
    _decode_attention_triton,
    _num_splits,
    decode_attention,
    decode_attention_reference,
)
from pipellm.kernels.kv_quant import dequantize_kv, quantize_kv, to_fp8

# the module (the package exports its public function under the same name)
da = importlib.import_module("pipellm.kernels.decode_attention")

N_HEADS = 8
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(lens, n_kv_heads, head_dim, dtype=torch.float32, n_heads=N_HEADS, seed=0):
    """Random q [B, H, D] and caches [cap, Hkv, D]: the sequences' segments sit in shuffled order
    at random gaps; unused slots hold large random garbage (a stray read shows up)."""
    g = torch.Generator().manual_seed(seed)
    starts, pos = [0] * len(lens), 0
    for b in torch.randperm(len(lens), generator=g).tolist():
        pos += int(torch.randint(1, 40, (1,), generator=g))
        starts[b], pos = pos, pos + lens[b]
    cap = pos + 17
    used = torch.zeros(cap, dtype=torch.bool)
    for s, n in zip(starts, lens, strict=True):
        used[s : s + n] = True
    garbage = torch.where(used, 1.0, 30.0)[:, None, None]  # [cap, 1, 1]
    k = torch.randn(cap, n_kv_heads, head_dim, generator=g) * garbage
    v = torch.randn(cap, n_kv_heads, head_dim, generator=g) * garbage
    q = torch.randn(len(lens), n_heads, head_dim, generator=g)
    ints = dict(dtype=torch.int32)
    return (q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor(starts, **ints),
            torch.tensor(lens, **ints))


def dense_attention(q, k, v, starts, lens, scale, window=0, softcap=0.0):
    """Padded gather + masked softmax in float64: q [B, H, D], k/v [cap, Hkv, D] -> [B, H, D].
    window > 0: the query (position len - 1) sees positions > len - 1 - window only. softcap > 0:
    scores s = q.k * scale become softcap * tanh(s / softcap) before the mask (Gemma 2)."""
    group = q.shape[1] // k.shape[1]
    pos = torch.arange(int(lens.max()))  # [L]
    idx = (starts[:, None].long() + pos[None, :]).clamp(max=k.shape[0] - 1)  # [B, L]
    kk = k.double()[idx].repeat_interleave(group, dim=2)  # [B, L, H, D]
    vv = v.double()[idx].repeat_interleave(group, dim=2)
    s = torch.einsum("bhd,blhd->bhl", q.double(), kk) * scale  # [B, H, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(pos[None, None, :] >= lens[:, None, None], float("-inf"))
    if window:
        s = s.masked_fill(pos[None, None, :] <= lens[:, None, None] - 1 - window, float("-inf"))
    return torch.einsum("bhl,blhd->bhd", s.softmax(dim=-1), vv)  # [B, H, D]


def check(q, k, v, starts, lens, out, scale=None, window=0):
    """out (any dtype) vs the reference on float32 copies of the inputs."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref = decode_attention_reference(q.float(), k.float(), v.float(), starts, lens, scale,
                                     window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out.float()).all()
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.fixture
def triton_backend():
    dispatch.set_backend("triton")
    yield
    dispatch.set_backend("auto")


@pytest.mark.parametrize("group", [1, 4])
def test_reference_matches_dense(group):
    q, k, v, starts, lens = make_case([1, 37, 300, 64], N_HEADS // group, 64)
    out = decode_attention_reference(q, k, v, starts, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, starts, lens, 0.125),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_triton_matches_reference(group, head_dim, splits):
    q, k, v, starts, lens = make_case([1, 37, 300], N_HEADS // group, head_dim, seed=group)
    out = _decode_attention_triton(q, k, v, starts, lens, head_dim**-0.5, 300, num_splits=splits)
    check(q, k, v, starts, lens, out)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group,dtype", [(1, torch.float32), (4, torch.float32),
                                         (1, torch.bfloat16), (4, torch.bfloat16),
                                         (4, torch.float16)])
def test_triton_reads_int8_kv_like_the_reference(group, dtype, splits):
    """INT8 caches (pipellm/kernels/kv_quant.py), dequantized in registers (in fp16 by their bits
    for 16-bit queries): the kernel against the reference on the dequantized cache."""
    q, k, v, starts, lens = make_case([1, 37, 300], N_HEADS // group, 64, seed=7 + group)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    out = _decode_attention_triton(q.to(dtype), kq, vq, starts, lens, 0.125, 300,
                                   num_splits=splits, k_scale=ks, v_scale=vs)
    check(q.to(dtype), dequantize_kv(kq, ks), dequantize_kv(vq, vs), starts, lens, out,
          scale=0.125)


@pytest.mark.parametrize("splits", [3, 8])
@pytest.mark.parametrize("group", [1, 4])
def test_fused_merge_matches_reference_and_leaves_counters_zero(group, splits):
    """The last program of each (sequence, kv head) merges the splits in the split kernel:
    the two-launch path's output, short sequences' empty splits counted too, and the counters
    zero again after every launch (a second launch, as a graph replays it, is right too)."""
    fused = da.replace(TILINGS["16bit"], fused=True)
    q, k, v, starts, lens = make_case([1, 37, 300], N_HEADS // group, 64, seed=11 + group)
    for _ in range(2):
        out = _decode_attention_triton(q, k, v, starts, lens, 0.125, 300, num_splits=splits,
                                       tiling=fused)
        check(q, k, v, starts, lens, out, scale=0.125)
        assert not arrivals._buffers[q.device].any()
    two = _decode_attention_triton(q, k, v, starts, lens, 0.125, 300, num_splits=splits)
    torch.testing.assert_close(out, two, atol=1e-6, rtol=1e-6)


def test_fused_merge_with_int8_window_and_softcap():
    fused = da.replace(TILINGS["int8"], fused=True)
    q, k, v, starts, lens = make_case([3, 90, 200], 2, 64, dtype=torch.bfloat16, seed=5)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    kw = dict(k_scale=ks, v_scale=vs, window=64, softcap=30.0)
    out = _decode_attention_triton(q, kq, vq, starts, lens, 0.125, 200, 4, tiling=fused, **kw)
    two = _decode_attention_triton(q, kq, vq, starts, lens, 0.125, 200, 4, **kw)
    torch.testing.assert_close(out.float(), two.float(), atol=1e-2, rtol=1e-2)
    ref = decode_attention_reference(q.float(), kq, vq, starts, lens, 0.125, **kw)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_fused_merge_falls_back_to_two_launches_beyond_its_counters(monkeypatch):
    monkeypatch.setattr(arrivals, "SLOTS", 4)  # B * n_kv_heads = 6 pairs: more than it counts
    assert arrivals.counters(torch.device("cpu"), 6) is None
    q, k, v, starts, lens = make_case([40, 80, 120], 2, 64, seed=2)
    out = _decode_attention_triton(q, k, v, starts, lens, 0.125, 120, num_splits=4,
                                   tiling=da.replace(TILINGS["16bit"], fused=True))
    check(q, k, v, starts, lens, out, scale=0.125)


@pytest.mark.parametrize("splits", [1, 4])
def test_kv_length_one(splits):
    q, k, v, starts, lens = make_case([1, 1, 1], 2, 64)
    out = _decode_attention_triton(q, k, v, starts, lens, 0.125, 1, num_splits=splits)
    check(q, k, v, starts, lens, out, scale=0.125)
    # one key: the output is that key's value row, for every query head of its kv head
    expected = v[starts.long()].repeat_interleave(N_HEADS // 2, dim=1)  # [B, H, D]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 8])
def test_low_precision(group, dtype):
    # bf16 tl.dot is wrong in the interpreter: the launcher upcasts the GQA dots to fp32 there
    q, k, v, starts, lens = make_case([5, 129, 70], N_HEADS // group, 64, dtype=dtype)
    out = _decode_attention_triton(q, k, v, starts, lens, 0.125, 129, num_splits=2)
    check(q, k, v, starts, lens, out, scale=0.125)


def test_heuristic_splits_end_to_end():
    q, k, v, starts, lens = make_case([700, 3], 2, 64)
    assert _num_splits(2, 2, 700, q.device) > 1  # small batch, long sequence: splits
    check(q, k, v, starts, lens, _decode_attention_triton(q, k, v, starts, lens, 0.125, 700),
          scale=0.125)


def test_public_function_triton(triton_backend, monkeypatch):
    q, k, v, starts, lens = make_case([2, 90, 200], 2, 64, seed=3)
    check(q, k, v, starts, lens, decode_attention(q, k, v, starts, lens))  # default scale
    monkeypatch.setattr(da, "_FORCED_SPLITS", 4)
    out = decode_attention(q, k, v, starts, lens, 0.1, max_seq_len=200)
    check(q, k, v, starts, lens, out, scale=0.1)


@pytest.fixture(scope="module")
def cpu_ext():
    ext = cpu_extension()
    assert ext is not None, "the C++ CPU kernels did not build (see the log)"
    return ext


@pytest.fixture(params=["generic", "avx2", "avx512"])
def attention_level(cpu_ext, request):
    """Each path of the C++ decode attention this CPU runs: its vectorized variants (chosen by
    the kernels' ISA level, so the AVX2 one is tested on any x86 machine) and the generic code
    (what INT8 caches and other head sizes take, selected here by choosing no level)."""
    from pipellm.kernels.cpu import isa

    if request.param != "generic" and request.param not in isa.cpu_levels():
        pytest.skip(f"this CPU does not run {request.param} ({isa.describe()})")
    previous = cpu_ext.block_gemm_isa()
    cpu_ext.set_block_gemm_isa("" if request.param == "generic" else request.param)
    yield request.param
    cpu_ext.set_block_gemm_isa(previous)


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [
    (8, 8, 64), (9, 3, 64), (8, 2, 32), (4, 1, 128), (16, 2, 64), (6, 3, 16), (4, 2, 256),
    (4, 2, 96), (5, 1, 80), (4, 4, 72), (4, 2, 36)])
# 96, 80, 72: vectors counted at run time (72 on AVX2's at the avx512 level); 36: generic code
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_reference(attention_level, cpu_ext, n_heads, n_kv_heads, head_dim,
                                      dtype):
    q, k, v, starts, lens = make_case([1, 7, 64, 300, 33], n_kv_heads, head_dim, dtype,
                                      n_heads=n_heads, seed=n_heads + head_dim)
    check(q, k, v, starts, lens, cpu_ext.decode_attention(q, k, v, starts, lens, 0.2), 0.2)


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(9, 3, 64), (4, 1, 128), (4, 2, 96),
                                                          (4, 2, 36)])
@pytest.mark.parametrize("window", [0, 37])
def test_cpu_kernel_reads_fp16_caches_under_float32_queries(attention_level, cpu_ext, n_heads,
                                                            n_kv_heads, head_dim, window):
    """--kv-cache-dtype float16: float32 q over fp16 caches, float32 out, on every path (36:
    the generic code), against the reference on the caches' float32 values; a cache of another
    dtype than q's (bf16 under float32) is refused."""
    q, k, v, starts, lens = make_case([1, 7, 64, 300, 33], n_kv_heads, head_dim,
                                      n_heads=n_heads, seed=head_dim + window)
    kh, vh = k.half(), v.half()
    out = cpu_ext.decode_attention(q, kh, vh, starts, lens, 0.2, None, None, window)
    assert out.dtype == torch.float32
    check(q, kh.float(), vh.float(), starts, lens, out, 0.2, window=window)
    assert torch.equal(decode_attention(q, kh, vh, starts, lens, 0.2, window=window), out)
    ref = decode_attention_reference(q, kh, vh, starts, lens, 0.2, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="caches must be q's dtype"):
        cpu_ext.decode_attention(q, k.bfloat16(), v.bfloat16(), starts, lens, 0.2)


@pytest.mark.parametrize("head_dim,at_avx2,at_avx512", [
    (64, "avx2", "avx512"), (96, "avx2", "avx512"), (80, "avx2", "avx512"), (8, "avx2", "avx2"),
    (72, "avx2", "avx2"), (256, "avx2", "avx512"), (36, "", ""), (264, "", ""), (0, "", "")])
def test_cpu_kernel_variant_by_head_dim(attention_level, cpu_ext, head_dim, at_avx2, at_avx512):
    """The code a float cache's head takes (what --kv-cache-dtype auto asks): the level's own
    vectors where head_dim is a multiple of them up to 256, AVX2's where it is a multiple of 8
    only (an AVX-512 CPU runs both), else the generic code ("")."""
    want = {"generic": "", "avx2": at_avx2, "avx512": at_avx512}[attention_level]
    assert cpu_ext.decode_attention_variant(head_dim) == want


def test_cpu_kernel_shares_a_varied_batch_among_threads(attention_level, cpu_ext):
    """Many sequences of lengths from 1 to 400 in random order, taken longest first from a
    shared counter by every thread (decode_attention_schedule.h): each output row is its own
    sequence's, with a window (fewer rows read than the length) and without."""
    g = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 401, (41,), generator=g).tolist()
    q, k, v, starts, lens_t = make_case(lens, 3, 64, torch.bfloat16, n_heads=9, seed=11)
    for window in (0, 50):
        out = cpu_ext.decode_attention(q, k, v, starts, lens_t, 0.125, None, None, window)
        check(q, k, v, starts, lens_t, out, 0.125, window)


@pytest.mark.parametrize("threads", [2, 5])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(9, 3), (8, 8), (4, 1), (8, 2)])
def test_cpu_kernel_splits_a_small_batch_by_kv_heads_and_context(attention_level, cpu_ext,
                                                                 n_heads, n_kv_heads, threads):
    """Fewer sequences than threads (a single decode): a long sequence cut along its rows into
    context parts whose partial sums are merged, a short one into parts of its kv heads
    (decode_attention_schedule.h's for_each_part), with a soft-cap and windows too: long,
    short, one-row and mixed batches."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in ([300], [77, 5], [1000], [700, 1, 64, 129]):
            q, k, v, starts, lens_t = make_case(lens, n_kv_heads, 64, torch.bfloat16,
                                                n_heads=n_heads, seed=len(lens) + n_heads)
            check(q, k, v, starts, lens_t, cpu_ext.decode_attention(q, k, v, starts, lens_t,
                                                                    0.125), 0.125)
            for window in (40, 333):
                out = cpu_ext.decode_attention(q, k, v, starts, lens_t, 0.125, None, None,
                                               window, 3.0)
                ref = dense_attention(q.float(), k.float(), v.float(), starts, lens_t, 0.125,
                                      window, 3.0)
                tol = TOL[q.dtype]
                torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(before)


def test_cpu_kernel_context_parts_of_float32_queries_over_fp16_caches(attention_level, cpu_ext):
    """--kv-cache-dtype float16 under float32 queries, one long sequence cut into context
    parts on two threads: the reference on the caches' float32 values."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v, starts, lens = make_case([1000], 3, 64, n_heads=9, seed=5)
        kh, vh = k.half(), v.half()
        out = cpu_ext.decode_attention(q, kh, vh, starts, lens, 0.2)
        check(q, kh.float(), vh.float(), starts, lens, out, 0.2)
    finally:
        torch.set_num_threads(before)


def test_cpu_kernel_reads_strided_queries(cpu_ext):
    """q as the engine passes it: rows of a wider [T, H, D] view (the decode rows of a step)."""
    q, k, v, starts, lens = make_case([5, 80, 2], 2, 64, seed=7)
    wide = torch.randn(3, 2 * N_HEADS, 64)[:, :N_HEADS]  # non-contiguous: batch stride 2*H*D
    wide.copy_(q)
    check(q, k, v, starts, lens, cpu_ext.decode_attention(wide, k, v, starts, lens, 0.125))


def test_public_function_on_cpu_uses_the_cpu_kernel_unless_reference(cpu_ext, monkeypatch):
    q, k, v, starts, lens = make_case([3, 40], 4, 64)
    calls = []
    monkeypatch.setattr(da, "decode_attention_reference",
                        lambda *a: calls.append(1) or decode_attention_reference(*a))
    check(q, k, v, starts, lens, decode_attention(q, k, v, starts, lens))
    assert calls == []
    dispatch.set_backend("reference")
    try:
        expected = decode_attention_reference(q, k, v, starts, lens, 0.125)
        assert torch.equal(decode_attention(q, k, v, starts, lens), expected) and calls == [1]
    finally:
        dispatch.set_backend("auto")


def test_num_splits_heuristic():
    cpu = torch.device("cpu")  # no CUDA: assumes an H100's 132 SMs
    assert _num_splits(256, 8, 8192, cpu) == 1  # the batch fills the GPU
    assert _num_splits(1, 8, 100, cpu) == 1  # too short to split
    assert _num_splits(1, 8, 1024, cpu) == 4  # >= 256 tokens per split
    assert _num_splits(1, 8, 1 << 20, cpu) == 64  # capped, a power of 2
    assert _num_splits(16, 8, 1 << 20, cpu) == 4  # 4 waves of 132 SMs: ceil(528/128) -> 4
    assert _num_splits(1, 8, 4096, cpu, TILINGS["16bit"].min_split_tokens) == 64  # shipped


def test_rejects_bad_shapes():
    q, k, v, starts, lens = make_case([3], 2, 64)
    with pytest.raises(ValueError, match="power of 2"):
        _decode_attention_triton(q[..., :48], k[..., :48], v[..., :48], starts, lens, 1.0, 3)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        _decode_attention_triton(q[:, :7], k, v, starts, lens, 1.0, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,max_len", [(64, 2048), (2, 20000)])
def test_gpu_large(dtype, batch, max_len):
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    lens[0] = max_len
    q, k, v, starts, lens_t = make_case(lens, 8, 128, dtype=dtype, n_heads=32, seed=batch)
    q, k, v, starts, lens_t = (t.cuda() for t in (q, k, v, starts, lens_t))
    out = decode_attention(q, k, v, starts, lens_t, max_seq_len=max_len)  # auto: Triton
    check(q, k, v, starts, lens_t, out)
    for splits in (1, 7):
        out = _decode_attention_triton(q, k, v, starts, lens_t, 128**-0.5, max_len, splits)
        check(q, k, v, starts, lens_t, out)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_quantized_kv(kv, dtype):
    """INT8 and FP8 caches on CUDA (their dots in fp16) at Llama-3-8B's heads, long and short
    sequences, against the reference on the dequantized cache."""
    q, k, v, starts, lens = make_case([4096, 1, 777, 2048], 8, 128, n_heads=32, seed=9)
    if kv == "int8":
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        kd, vd = dequantize_kv(kq, ks), dequantize_kv(vq, vs)
        extra = dict(k_scale=ks.cuda(), v_scale=vs.cuda())
    else:
        kq, vq = to_fp8(k), to_fp8(v)
        kd, vd, extra = kq.float(), vq.float(), {}
    args = [t.cuda() for t in (q.to(dtype), kq, vq, starts, lens)]
    for splits in (None, 1, 7):
        out = _decode_attention_triton(*args, 128**-0.5, 4096, splits, **extra)
        check(q.to(dtype), kd, vd, starts, lens, out.cpu())


# --- sliding window: the query at position len - 1 sees keys (len - 1 - window, len - 1] ------

WINDOWS = [1, 16, 37, 300, 1000]  # lens 1, 37, 300: smaller than, equal to, larger than each


def poison_outside_window(k, v, starts, lens, window):
    """NaN in every segment row before the window: a kernel that reads one (even masked: NaN x
    0 is NaN) returns NaN."""
    k, v = k.clone(), v.clone()
    for s, n in zip(starts.tolist(), lens.tolist(), strict=True):
        k[s : s + max(0, n - window)] = float("nan")
        v[s : s + max(0, n - window)] = float("nan")
    return k, v


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_window_matches_dense(window):
    q, k, v, starts, lens = make_case([1, 37, 300, 64], N_HEADS // 4, 64, seed=11)
    out = decode_attention_reference(q, k, v, starts, lens, 0.125, window=window)
    torch.testing.assert_close(out.double(), dense_attention(q, k, v, starts, lens, 0.125, window),
                               atol=1e-5, rtol=1e-5)
    if window < 300:  # the window changes the result
        assert not torch.allclose(out, decode_attention_reference(q, k, v, starts, lens, 0.125))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_window_matches_reference(window, group, splits):
    """The splits share out only the window's keys; the rows before it are never read."""
    q, k, v, starts, lens = make_case([1, 37, 300], N_HEADS // group, 64, seed=window + group)
    kp, vp = poison_outside_window(k, v, starts, lens, window)
    out = _decode_attention_triton(q, kp, vp, starts, lens, 0.125, 300, num_splits=splits,
                                   window=window)
    check(q, k, v, starts, lens, out, scale=0.125, window=window)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [16, 300])
def test_triton_window_on_int8_kv(window, splits):
    q, k, v, starts, lens = make_case([5, 37, 300], N_HEADS // 4, 64, seed=21)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    out = _decode_attention_triton(q, kq, vq, starts, lens, 0.125, 300, num_splits=splits,
                                   k_scale=ks, v_scale=vs, window=window)
    check(q, dequantize_kv(kq, ks), dequantize_kv(vq, vs), starts, lens, out, scale=0.125,
          window=window)


def test_public_function_window_triton(triton_backend):
    """The heuristic's split count with a window (capped by it), through `decode_attention`."""
    q, k, v, starts, lens = make_case([700, 3, 90], 2, 64, seed=4)
    kp, vp = poison_outside_window(k, v, starts, lens, 64)
    out = decode_attention(q, kp, vp, starts, lens, 0.125, max_seq_len=700, window=64)
    check(q, k, v, starts, lens, out, scale=0.125, window=64)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_window_matches_reference(attention_level, cpu_ext, window, dtype):
    q, k, v, starts, lens = make_case([1, 37, 300, 64], 2, 64, dtype, seed=window)
    kp, vp = poison_outside_window(k, v, starts, lens, window)
    out = cpu_ext.decode_attention(q, kp, vp, starts, lens, 0.2, window=window)
    check(q, k, v, starts, lens, out, 0.2, window=window)
    assert torch.equal(decode_attention(q, kp, vp, starts, lens, 0.2, window=window), out)


@pytest.mark.parametrize("window", [16, 37, 1000])
def test_cpu_kernel_window_on_int8_kv(cpu_ext, window):
    q, k, v, starts, lens = make_case([1, 37, 300], 2, 64, seed=5)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    out = cpu_ext.decode_attention(q, kq, vq, starts, lens, 0.125, ks, vs, window)
    check(q, dequantize_kv(kq, ks), dequantize_kv(vq, vs), starts, lens, out, 0.125,
          window=window)


# --- logit soft-capping (Gemma 2): scores s = scale * q.k -> softcap * tanh(s / softcap) ------


@pytest.mark.parametrize("window,int8", [(0, False), (16, False), (16, True)])
def test_softcap_every_path_matches_dense(cpu_ext, window, int8):
    """The reference, the Triton kernel (3 splits) and the C++ kernel against a float64 eager
    softmax of capped scores; q is scaled so that most |scores| exceed the cap of 5."""
    q, k, v, starts, lens = make_case([1, 37, 300], 2, 64, seed=31 + window)
    q = q * 4  # scores ~ N(0, 4^2): the cap matters
    kv, scales = (k, v), {}
    if int8:  # the kernels read the INT8 cache, the dense softmax its dequantized values
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        kv, scales = (kq, vq), dict(k_scale=ks, v_scale=vs)
        k, v = dequantize_kv(kq, ks), dequantize_kv(vq, vs)
    exp = dense_attention(q, k, v, starts, lens, 0.125, window, softcap=5.0)
    assert not torch.allclose(exp, dense_attention(q, k, v, starts, lens, 0.125, window),
                              atol=1e-2)  # the cap changes the output
    outs = {
        "reference": decode_attention_reference(q, *kv, starts, lens, 0.125, **scales,
                                                window=window, softcap=5.0),
        "triton": _decode_attention_triton(q, *kv, starts, lens, 0.125, 300, num_splits=3,
                                           **scales, window=window, softcap=5.0),
        "cpp": cpu_ext.decode_attention(q, *kv, starts, lens, 0.125, window=window,
                                        softcap=5.0, **scales),
        "public": decode_attention(q, *kv, starts, lens, 0.125, **scales, window=window,
                                   softcap=5.0),  # auto on CPU: the C++ kernel
    }
    for name, out in outs.items():
        torch.testing.assert_close(out.double(), exp, atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("window", [0, 16])
def test_cpu_softcap_at_every_level(attention_level, cpu_ext, window):
    q, k, v, starts, lens = make_case([1, 37, 300], 2, 64, seed=41 + window)
    q = q * 4
    exp = dense_attention(q, k, v, starts, lens, 0.125, window, softcap=5.0)
    out = cpu_ext.decode_attention(q, k, v, starts, lens, 0.125, window=window, softcap=5.0)
    torch.testing.assert_close(out.double(), exp, atol=1e-5, rtol=1e-5)
