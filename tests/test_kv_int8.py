"""INT8 KV cache (--kv-cache-dtype int8): the quantizer, the kernels that write and read it,
moves, and the engine on it against the 16/32-bit cache."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels.decode_attention import decode_attention, decode_attention_reference
from pipellm.kernels.kv_quant import KV_GROUP, dequantize_kv, quantize_kv
from pipellm.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from pipellm.kernels.rope import rope_kv_write
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.shared.config import EngineConfig
from pipellm.shared.sampling import SamplingParams


def test_quantize_round_trip_error_is_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(37, 3, 64) * torch.rand(37, 3, 1) * 10
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float16
    assert q.shape == x.shape and s.shape == (37, 3, 64 // KV_GROUP)
    err = (dequantize_kv(q, s) - x).abs().view(37, 3, -1, KV_GROUP).amax(-1)
    assert (err <= s.float() * 0.5 + 1e-6).all()  # within half a quantization step
    assert q.abs().max() == 127
    zeros = quantize_kv(torch.zeros(2, 1, 16))
    assert zeros[0].eq(0).all() and zeros[1].eq(0).all()


def int8_cache(k: torch.Tensor, v: torch.Tensor):
    """An INT8 layer holding k, v [capacity, Hkv, D], and its dequantized float twin."""
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return (kq, vq, ks, vs), (dequantize_kv(kq, ks), dequantize_kv(vq, vs))


def test_attention_on_int8_equals_attention_on_its_dequantized_cache():
    torch.manual_seed(1)
    cap, hkv, h, d = 300, 2, 6, 64
    k, v = torch.randn(cap, hkv, d), torch.randn(cap, hkv, d)
    (kq, vq, ks, vs), (kf, vf) = int8_cache(k, v)
    starts, lens = torch.tensor([0, 100, 210], dtype=torch.int32), torch.tensor(
        [90, 1, 77], dtype=torch.int32)
    q = torch.randn(3, h, d)
    got = decode_attention(q, kq, vq, starts, lens, 0.125, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, decode_attention_reference(q, kf, vf, starts, lens, 0.125))
    exact = decode_attention_reference(q, k, v, starts, lens, 0.125)
    assert (got - exact).abs().max() < 0.05  # the quantization's own error, small
    cu = torch.tensor([0, 5, 5, 45], dtype=torch.int32)  # chunks of 5, 0 and 40 new tokens
    ctx = torch.tensor([30, 1, 77], dtype=torch.int32)
    qp = torch.randn(45, h, d)
    got = prefill_attention(qp, kq, vq, cu, starts, ctx, 0.125, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, prefill_attention_reference(qp, kf, vf, cu, starts, ctx,
                                                                0.125), atol=1e-5, rtol=1e-5)


def test_rope_kv_write_quantizes_the_rows_it_writes():
    torch.manual_seed(2)
    t, h, hkv, d, cap = 7, 4, 2, 32, 20
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    pos = torch.arange(3, 3 + t)
    ang = torch.rand(64, d // 2)
    cos, sin = ang.cos(), ang.sin()
    slots = torch.tensor([9, 2, 4, 15, 0, 11, 7])
    kf, vf = torch.zeros(cap, hkv, d), torch.zeros(cap, hkv, d)
    q_rot, k_rot = rope_kv_write(q, k, v, pos, cos, sin, kf, vf, slots)
    kq, vq = torch.zeros(cap, hkv, d, dtype=torch.int8), torch.zeros(cap, hkv, d,
                                                                     dtype=torch.int8)
    ks = torch.zeros(cap, hkv, d // KV_GROUP, dtype=torch.float16)
    vs = torch.zeros_like(ks)
    q_rot8, _ = rope_kv_write(q, k, v, pos, cos, sin, kq, vq, slots, ks, vs)
    torch.testing.assert_close(q_rot8, q_rot)
    assert torch.equal(kq[slots], quantize_kv(kf[slots])[0])
    assert torch.equal(vs[slots], quantize_kv(vf[slots])[1])
    others = torch.ones(cap, dtype=torch.bool)
    others[slots] = False
    assert kq[others].eq(0).all() and ks[others].eq(0).all()  # nothing else written


def test_moves_carry_the_scales_and_capacity_counts_them():
    kv = KVCache(2, 50, 2, 16, torch.float32, torch.device("cpu"), kv_dtype="int8")
    kv.k.random_(-127, 127)
    kv.k_scale.uniform_()
    before = kv.k[:, 10:20].clone(), kv.k_scale[:, 10:20].clone()
    kv.move(10, 15, 10)  # overlapping ranges
    assert torch.equal(kv.k[:, 15:25], before[0]) and torch.equal(kv.k_scale[:, 15:25], before[1])
    assert KVCache.bytes_per_token(2, 2, 16, torch.float32, kv_dtype="int8") == 2 * 2 * 2 * (16 + 4)
    ratio = (KVCache.bytes_per_token(30, 3, 64, torch.bfloat16)
             / KVCache.bytes_per_token(30, 3, 64, torch.bfloat16, kv_dtype="int8"))
    assert ratio == pytest.approx(1.6)  # against a 16-bit cache


def test_engine_on_int8_kv_agrees_with_the_float_cache(kv_engines):
    prompts = [[1] + [(13 * i + 7 * j) % 900 + 3 for j in range(20 + 11 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    ref = kv_engines("float32", kv_cache_tokens=2048).generate(prompts, params)
    got = kv_engines("int8", kv_cache_tokens=2048).generate(prompts, params)
    same = sum(a == b for r, g in zip(ref, got, strict=True)
               for a, b in zip(r.output_ids, g.output_ids, strict=True))
    assert same / (24 * len(prompts)) > 0.8
    first = [abs(r.logprobs[0] - g.logprobs[0]) for r, g in zip(ref, got, strict=True)]
    assert max(first) < 0.05  # the first token sees only quantized prompt K/V


def test_int8_kv_survives_moves_and_preemption(kv_engines):
    prompts = [[1] + [(7 * i + j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    sp = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True)
          for i in range(8)]
    roomy = kv_engines("int8", kv_cache_tokens=4096).generate(prompts, sp)
    tight = kv_engines("int8", kv_cache_tokens=160, max_batched_tokens=32, max_running=8,
                    default_predicted_len=2, kv_min_grow=2)
    out = tight.generate(prompts, sp)
    assert [s.output_ids for s in out] == [s.output_ids for s in roomy]
    stats = tight.stats()
    assert stats.moves + stats.grows_in_place > 0 and stats.preemptions > 0


def test_int8_capacity_at_the_same_memory(kv_engines):
    float_cap = kv_engines("float32", kv_cache_gib=0.01).runner.capacity
    int8_cap = kv_engines("int8", kv_cache_gib=0.01).runner.capacity
    assert int8_cap / float_cap == pytest.approx(4 / 1.25, rel=0.01)  # fp32 -> 1.25 B a value
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_cpu_kernel_reads_int8_like_the_reference():
    """The C++ decode kernel (--kernels auto on a CPU) on INT8 caches, fp32 and bf16 queries."""
    from pipellm.kernels import dispatch
    from pipellm.kernels.cpu import extension

    if extension() is None:
        pytest.skip("the C++ CPU kernels do not build here")
    assert dispatch.cpu_extension(torch.zeros(1)) is not None
    torch.manual_seed(3)
    cap, hkv, h, d = 200, 3, 9, 64
    (kq, vq, ks, vs), (kf, vf) = int8_cache(torch.randn(cap, hkv, d), torch.randn(cap, hkv, d))
    starts, lens = torch.tensor([5, 150, 0], dtype=torch.int32), torch.tensor(
        [140, 50, 1], dtype=torch.int32)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(3, h, d).to(dtype)
        got = decode_attention(q, kq, vq, starts, lens, 0.125, k_scale=ks, v_scale=vs)
        ref = decode_attention_reference(q.float(), kf, vf, starts, lens, 0.125)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
