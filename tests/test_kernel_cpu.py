"""The C++ CPU row kernels (pipellm/kernels/cpu: norm.cpp, activation.cpp, int8_quant.cpp,
rope.cpp), each against its PyTorch reference on random inputs: float32 and bfloat16, T in {1, 3,
37}, odd widths, strided rows as the model passes them (q/k/v split from the fused qkv output).

Where the kernel makes the reference's roundings (everything but the order of RMSNorm's sum of
squares, exp's implementation in silu_mul, and RoPE / silu_mul in bf16, which round once where
the reference rounds each product), results are compared bit for bit. (The C++ decode attention is
tested in test_kernel_decode_attention.py.)
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from pipellm.kernels import activation, dispatch, int8_quant, rmsnorm, rope
from pipellm.kernels.activation import silu_mul_ref
from pipellm.kernels.cpu import extension
from pipellm.kernels.int8_quant import quantize_int8_ref, silu_mul_int8_ref
from pipellm.kernels.kv_quant import quantize_kv
from pipellm.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref
from pipellm.kernels.rope import rope_kv_write_ref
from pipellm.services.compute.model.rope import RotaryEmbedding

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]
TS = [1, 3, 37]
ULP = {torch.float32: dict(rtol=1e-6, atol=1e-6),  # fp32: a few ulp (reduction / exp order)
       torch.bfloat16: dict(rtol=2.0**-7, atol=1e-5)}  # bf16: one ulp


@pytest.fixture(scope="module")
def ext():
    module = extension()
    assert module is not None, "the C++ CPU kernels did not build (see the log)"
    return module


# the levels a row kernel has a variant for (silu_mul and bf16 RMSNorm: the portable loop below
# AVX-512, activation_avx512.cpp / norm_avx512.cpp from it), through conftest's
# block_gemm_level: both on an AVX-512 CPU
ROW_LEVELS = pytest.mark.parametrize("block_gemm_level", ["avx2", "avx512"], indirect=True)


def _rand(*shape, dtype=torch.float32, seed=0, scale=2.0):
    """Random values without zeros (an offset keeps them off 0). Every test here draws from its
    own generator: the global RNG state later test files see stays as it was."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + 0.05).to(dtype)


def _strided(x: torch.Tensor, pad: int = 7) -> torch.Tensor:
    """x [T, n] as a view with a row stride of n + pad (same values)."""
    wide = torch.full((x.shape[0], x.shape[1] + pad), 99.0, dtype=x.dtype)
    wide[:, 3:3 + x.shape[1]] = x
    return wide[:, 3:3 + x.shape[1]]


def _dyadic(T, n, dtype, seed=0):
    """Values k/8, 1 <= |k| <= 16: their sum of squares is exact in any order, so the RMSNorm
    kernels must match the reference bit for bit."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 17, (T, n), generator=g)
    sign = torch.randint(0, 2, (T, n), generator=g) * 2 - 1
    return (k * sign / 8).to(dtype)


def _close_int8(got, ref, max_off_by_one=0.01):
    """Scales within float32 rounding; values equal but for rare ties, by at most one step."""
    values, scales = got
    torch.testing.assert_close(scales, ref.scales, rtol=1e-5, atol=0)
    diff = (values.int() - ref.values.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= max_off_by_one


# ---- RMSNorm -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("n", [576, 577])
@pytest.mark.parametrize("strided", [False, True])
@ROW_LEVELS
def test_rms_norm_and_add(ext, block_gemm_level, dtype, T, n, strided):
    x, res = _rand(T, n, dtype=dtype, seed=T), _rand(T, n, dtype=dtype, seed=T + 1, scale=1.0)
    w = (torch.rand(n, generator=torch.Generator().manual_seed(2)) + 0.25).to(dtype)
    if strided:
        x, res = _strided(x), _strided(res, pad=3)
    out = ext.rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.shape == (T, n)
    torch.testing.assert_close(out, rms_norm_ref(x, w, EPS), **ULP[dtype])
    out, h = ext.add_rms_norm(x, res, w, EPS)
    ref_out, ref_h = add_rms_norm_ref(x, res, w, EPS)
    assert torch.equal(h, ref_h)  # residual + x: one rounding, as torch's add
    torch.testing.assert_close(out, ref_out, **ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("n", [576, 577])  # bf16: 576 takes the AVX-512 rows at that level
@ROW_LEVELS
def test_rms_norm_bit_exact_on_exact_sums(ext, block_gemm_level, dtype, n):
    x, res = _dyadic(37, n, dtype), _dyadic(37, n, dtype, seed=1) / 2
    w = _dyadic(1, n, dtype, seed=2)[0]
    assert torch.equal(ext.rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS))
    for got, want in zip(ext.add_rms_norm(x, res, w, EPS), add_rms_norm_ref(x, res, w, EPS),
                         strict=True):
        assert torch.equal(got, want)
    x3 = x.view(37, 1, n).expand(37, 2, n)  # leading dims, a broadcast view
    assert torch.equal(ext.rms_norm(x3, w, EPS), rms_norm_ref(x3, w, EPS))


def _norm_int8_ref(x, res, w):
    normed, h = (rms_norm_ref(x, w, EPS), None) if res is None else add_rms_norm_ref(x, res, w, EPS)
    return quantize_int8_ref(normed.reshape(-1, x.shape[-1])), h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_int8(ext, dtype, T, with_residual):
    x, w = _rand(T, 577, dtype=dtype, seed=T), _rand(577, dtype=dtype, seed=5).abs() + 0.25
    res = _strided(_rand(T, 577, dtype=dtype, seed=9)) if with_residual else None
    values, scales, h = ext.rms_norm_int8(_strided(x), res, w, EPS)
    ref, ref_h = _norm_int8_ref(x, res, w)
    assert values.dtype == torch.int8 and values.shape == (T, 577) and scales.dtype == torch.float32
    _close_int8((values, scales), ref)  # the normed rows may differ by an ulp (sum order)
    assert (h is None and ref_h is None) if res is None else torch.equal(h, ref_h)
    xd, rd = _dyadic(T, 577, dtype), _dyadic(T, 577, dtype, seed=3) if with_residual else None
    values, scales, _ = ext.rms_norm_int8(xd, rd, w, EPS)  # exact sums: bit for bit
    ref, _ = _norm_int8_ref(xd, rd, w)
    assert torch.equal(values, ref.values) and torch.equal(scales, ref.scales)


# ---- INT8 activations and SiLU x mul --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TS)
def test_quantize_int8_is_the_reference(ext, dtype, T):
    x = _rand(T, 577, dtype=dtype, seed=T, scale=3.0)
    x[0, 5] = 40.0  # an outlier sets its row's scale
    if T > 1:
        x[1] = 0.0  # a row of zeros: scale 0, values 0
    for rows in (x, _strided(x), x.view(T, 1, 577)):
        values, scales = ext.quantize_int8(rows)
        ref = quantize_int8_ref(x)
        assert torch.equal(values, ref.values) and torch.equal(scales, ref.scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TS)
@ROW_LEVELS
def test_silu_mul(ext, block_gemm_level, dtype, T):
    gate_up = _rand(T, 2 * 769, dtype=dtype, seed=T, scale=3.0)  # I = 769, odd
    for x in (gate_up, _strided(gate_up)):
        out = ext.silu_mul(x)
        assert out.shape == (T, 769) and out.dtype == dtype
        # fp32: only exp's implementation differs; bf16: the reference rounds twice, the kernel
        # once (within an ulp of each other, the kernel within half an ulp of the exact value)
        torch.testing.assert_close(out, silu_mul_ref(x), **ULP[dtype])
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    ulps = 1 if dtype == torch.bfloat16 else 8  # bf16: one rounding; fp32: exp's few ulp too
    bound = ulps * torch.finfo(dtype).eps * exact.abs() + 1e-6
    assert ((ext.silu_mul(gate_up).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TS)
def test_silu_mul_int8(ext, dtype, T):
    gate_up = _rand(T, 2 * 1536, dtype=dtype, seed=T, scale=3.0)
    ref = silu_mul_int8_ref(gate_up)
    for x in (gate_up, _strided(gate_up), gate_up.view(T, 1, -1)):
        values, scales = ext.silu_mul_int8(x)  # silu by torch's own kernel: bit for bit
        assert torch.equal(values, ref.values) and torch.equal(scales, ref.scales)


# ---- RoPE + KV-cache write ------------------------------------------------------------------


def _rope_case(T, H, hkv, D, dtype, int8=False, index_dtype=torch.int64, seed=0):
    """q, k, v as views of one fused qkv [T, (H + 2 Hkv) D] (strided rows), tables, caches."""
    g = torch.Generator().manual_seed(seed)
    rope_emb = RotaryEmbedding(D, 4096, 10000.0, None, torch.device("cpu"))
    qkv = (torch.randn(T, (H + 2 * hkv) * D, generator=g) + 0.05).to(dtype)
    q, k, v = qkv.split([H * D, hkv * D, hkv * D], dim=-1)
    capacity = 100
    if int8:
        caches = torch.randint(-127, 128, (2, capacity, hkv, D), generator=g, dtype=torch.int8)
        scales = torch.rand(2, capacity, hkv, D // 8, generator=g).half()
    else:
        caches, scales = torch.randn(2, capacity, hkv, D, generator=g).to(dtype), (None, None)
    return dict(q=q.view(T, H, D), k=k.view(T, hkv, D), v=v.view(T, hkv, D),
                positions=torch.randint(0, 4096, (T,), generator=g).to(index_dtype),
                cos=rope_emb.cos, sin=rope_emb.sin, k_cache=caches[0], v_cache=caches[1],
                slots=torch.randperm(capacity, generator=g)[:T].to(index_dtype),
                k_scale=scales[0], v_scale=scales[1])


def _run(fn, args):
    """fn on copies of the caches -> (q_rot, k_rot, k_cache, v_cache, k_scale, v_scale)."""
    args = {n: t.clone() if n.endswith(("cache", "scale")) and t is not None else t
            for n, t in args.items()}
    q_rot, k_rot = fn(**args)
    return q_rot, k_rot, args["k_cache"], args["v_cache"], args["k_scale"], args["v_scale"]


def _rotation_bound(x):
    """|kernel - reference| bound in bf16: the reference's product roundings plus one rounding
    each side, < 3 eps (|x1| + |x2|) since |cos|, |sin| <= 1."""
    x1, x2 = x.float().chunk(2, dim=-1)
    a = 3 * torch.finfo(x.dtype).eps * (x1.abs() + x2.abs())
    return torch.cat((a, a), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("H,hkv,D", [(9, 3, 64), (6, 2, 96)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_rope_kv_write_float_caches(ext, dtype, T, H, hkv, D, index_dtype):
    args = _rope_case(T, H, hkv, D, dtype, index_dtype=index_dtype, seed=T)
    got, want = _run(ext.rope_kv_write, args), _run(rope_kv_write_ref, args)
    if dtype == torch.float32:  # the same roundings: bit for bit
        for a, b in zip(got[:4], want[:4], strict=True):
            assert torch.equal(a, b)
        return
    for x, a, b in ((args["q"], got[0], want[0]), (args["k"], got[1], want[1])):
        assert ((a.float() - b.float()).abs() <= _rotation_bound(x)).all()
    slots = args["slots"].long()
    assert torch.equal(got[2][slots], got[1]) and torch.equal(got[3][slots], args["v"])
    untouched = torch.ones(args["k_cache"].shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got[2][untouched], args["k_cache"][untouched])
    assert torch.equal(got[3][untouched], args["v_cache"][untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TS)
def test_rope_kv_write_int8_caches(ext, dtype, T):
    args = _rope_case(T, 9, 3, 64, dtype, int8=True, seed=T)
    got, want = _run(ext.rope_kv_write, args), _run(rope_kv_write_ref, args)
    if dtype == torch.float32:
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        return
    assert ((got[1].float() - want[1].float()).abs() <= _rotation_bound(args["k"])).all()
    slots = args["slots"].long()  # the rows written are quantize_kv's of k_rot and v, exactly
    for cache, scale, rows in ((got[2], got[4], got[1]), (got[3], got[5], args["v"])):
        values, scales = quantize_kv(rows)
        assert torch.equal(cache[slots], values) and torch.equal(scale[slots], scales)
    assert torch.equal(got[3], want[3]) and torch.equal(got[5], want[5])  # v: as the reference


@pytest.mark.parametrize("T", TS)
def test_rope_kv_write_fp16_caches_under_float32(ext, T):
    """--kv-cache-dtype float16: float32 rows written to fp16 caches rounded to nearest, bit
    for bit as the reference; q_rot and k_rot stay float32 and exact; a bf16 cache under
    float32 q is refused."""
    args = _rope_case(T, 9, 3, 64, torch.float32, seed=T)
    args |= {"k_cache": args["k_cache"].half(), "v_cache": args["v_cache"].half()}
    got, want = _run(ext.rope_kv_write, args), _run(rope_kv_write_ref, args)
    for a, b in zip(got[:4], want[:4], strict=True):
        assert torch.equal(a, b)
    slots = args["slots"].long()
    assert got[0].dtype == torch.float32 and torch.equal(got[2][slots], got[1].half())
    assert torch.equal(got[3][slots], args["v"].half())
    with pytest.raises(RuntimeError, match="caches must be q's dtype"):
        ext.rope_kv_write(**(args | {"k_cache": args["k_cache"].bfloat16(),
                                     "v_cache": args["v_cache"].bfloat16()}))


def test_rope_kv_write_refuses_bad_slots(ext):
    args = _rope_case(3, 9, 3, 64, torch.float32)
    args["slots"] = torch.tensor([0, 1, 100])  # capacity 100
    with pytest.raises(RuntimeError, match="slots out of range"):
        ext.rope_kv_write(**args)


# ---- dispatch -------------------------------------------------------------------------------


@pytest.fixture
def backend():
    previous = dispatch.backend()
    yield dispatch.set_backend
    dispatch.set_backend(previous)


def test_public_functions_take_the_extension_on_cpu(ext, backend, monkeypatch):
    """Under "auto" each public function calls the extension (bit-equal results); a weight of
    another dtype (norms) or an FP8 cache (RoPE) keeps the reference."""
    backend("auto")
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(ext, name)

    for module in (rmsnorm, activation, int8_quant, rope):
        monkeypatch.setattr(module, "cpu_extension",
                            lambda t: Spy() if dispatch.cpu_fast_path(t) else None)
    x, res, w = _rand(3, 64, seed=1), _rand(3, 64, seed=2), _rand(64, seed=3).abs() + 0.5
    assert torch.equal(rmsnorm.rms_norm(x, w, EPS), ext.rms_norm(x, w, EPS))
    assert torch.equal(rmsnorm.add_rms_norm(x, res, w, EPS)[0], ext.add_rms_norm(x, res, w, EPS)[0])
    act, h = rmsnorm.rms_norm_int8(x, res, w, EPS)
    assert torch.equal(act.values, ext.rms_norm_int8(x, res, w, EPS)[0]) and h is not None
    assert torch.equal(activation.silu_mul(x), ext.silu_mul(x))
    assert torch.equal(int8_quant.quantize_int8(x).scales, ext.quantize_int8(x)[1])
    assert torch.equal(int8_quant.silu_mul_int8(x).values, ext.silu_mul_int8(x)[0])
    args = _rope_case(2, 9, 3, 64, torch.float32)
    assert torch.equal(rope.rope_kv_write(**args)[0], ext.rope_kv_write(**args)[0])
    assert calls == ["rms_norm", "add_rms_norm", "rms_norm_int8", "silu_mul", "quantize_int8",
                     "silu_mul_int8", "rope_kv_write"]
    out = rmsnorm.rms_norm(x.bfloat16(), w, EPS)  # fp32 weight: the reference (promotes)
    assert out.dtype == torch.float32 and len(calls) == 7
    backend("reference")
    assert torch.equal(activation.silu_mul(x), silu_mul_ref(x)) and len(calls) == 7


def _runs_beside_python(call, margin_s: float = 0.03) -> tuple[bool, float]:
    """(whether another Python thread ran while `call()` did, the call's seconds): a sampler
    thread records times; one well inside the call (`margin_s` from either end, beyond the
    5 ms switch interval) could only have been taken if the call let go of the GIL."""
    times, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            times.append(time.perf_counter())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    sampler.join()
    return any(t0 + margin_s < t < t1 - margin_s for t in times), t1 - t0


def test_the_sampler_sees_a_call_that_holds_the_gil():
    """The check below can fail: a regex backtracking in C holds the GIL, and the sampler
    records nothing inside it."""
    beside, seconds = _runs_beside_python(lambda: re.match(r"(a+)+$", "a" * 23 + "b"))
    assert seconds > 0.15 and not beside


def test_a_kernel_lets_other_threads_run(ext):
    """The kernels release the GIL while they compute (bindings.cpp), as torch's ops do: a
    service's heartbeat thread keeps beating through a long prefill."""
    for t in (1024, 2048, 4096, 8192, 16384, 32768):
        q, k, v = _rand(t, 4, 64, seed=1), _rand(t, 2, 64, seed=2), _rand(t, 2, 64, seed=3)
        cu, starts, ctx = (torch.tensor(x, dtype=torch.int32) for x in ([0, t], [0], [t]))
        beside, seconds = _runs_beside_python(
            lambda q=q, k=k, v=v, cu=cu, s=starts, c=ctx: ext.prefill_attention(
                q, k, v, cu, s, c, 0.125))
        if seconds > 0.15:
            break
    assert seconds > 0.15 and beside
