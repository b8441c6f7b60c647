"""FP8 KV cache (--kv-cache-dtype fp8): e4m3 with scale 1, written saturated by the RoPE + KV
write (reference and Triton), read by every attention path; the engine on it against the float
cache, through moves and preemption."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels.decode_attention import _decode_attention_triton, decode_attention
from pipellm.kernels.kv_quant import FP8, FP8_MAX, to_fp8
from pipellm.kernels.prefill_attention import (
    _prefill_attention_triton,
    prefill_attention,
    prefill_attention_reference,
)
from pipellm.kernels.rope import rope_kv_write_ref, rope_kv_write_triton
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.shared.sampling import SamplingParams


def test_to_fp8_saturates_and_rounds_to_three_mantissa_bits():
    torch.manual_seed(0)
    x = torch.randn(4096) * 20
    x[:3] = torch.tensor([1000.0, -5000.0, 447.0])
    y = to_fp8(x).float()
    assert torch.isfinite(y).all() and y[0] == FP8_MAX and y[1] == -FP8_MAX
    normal = x.abs() > 2**-6  # e4m3's smallest normal
    rel = ((y - x).abs() / x.abs())[normal & (x.abs() <= FP8_MAX)]
    assert rel.max() <= 2**-4 + 1e-6  # half a step of 3 mantissa bits


def fp8_case(seed: int, cap: int = 300, hkv: int = 2, d: int = 64):
    torch.manual_seed(seed)
    k, v = to_fp8(torch.randn(cap, hkv, d) * 3), to_fp8(torch.randn(cap, hkv, d) * 3)
    return k, v, k.float(), v.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_fp8_like_its_float_copy(dtype, interpreter_bf16_dot):
    k, v, kf, vf = fp8_case(1)
    starts = torch.tensor([0, 100, 210], dtype=torch.int32)
    lens = torch.tensor([90, 1, 77], dtype=torch.int32)
    q = torch.randn(3, 6, 64).to(dtype)
    want = decode_attention(q.float(), kf, vf, starts, lens, 0.125)
    got_cpu = decode_attention(q, k, v, starts, lens, 0.125)  # off Triton: the reference
    got_triton = _decode_attention_triton(q, k, v, starts, lens, 0.125, 90, num_splits=2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_cpu.float(), want, **tol)
    torch.testing.assert_close(got_triton.float(), want, **tol)
    cu = torch.tensor([0, 5, 5, 45], dtype=torch.int32)
    ctx = torch.tensor([30, 1, 77], dtype=torch.int32)
    qp = torch.randn(45, 6, 64).to(dtype)
    want = prefill_attention_reference(qp.float(), kf, vf, cu, starts, ctx, 0.125)
    got_cpu = prefill_attention(qp, k, v, cu, starts, ctx, 0.125)
    got_triton = _prefill_attention_triton(qp, k, v, cu, starts, ctx, 0.125, 40, block_m=16,
                                           block_n=16)
    torch.testing.assert_close(got_cpu.float(), want, **tol)
    torch.testing.assert_close(got_triton.float(), want, **tol)


def test_rope_kv_write_stores_saturated_fp8_in_both_paths():
    torch.manual_seed(2)
    t, h, hkv, d, cap = 32, 4, 2, 32, 40
    q, k = torch.randn(t, h, d), torch.randn(t, hkv, d) * 5
    v = torch.randn(t, hkv, d) * torch.logspace(-4, 3, t)[:, None, None]  # subnormal to huge
    v[0, 0, :4] = torch.tensor([600.0, -900.0, 1e6, 3.0])
    pos, slots = torch.arange(3, 3 + t), torch.randperm(cap)[:t]
    ang = torch.rand(64, d // 2)
    cos, sin = ang.cos(), ang.sin()
    kf, vf = torch.zeros(cap, hkv, d), torch.zeros(cap, hkv, d)
    rope_kv_write_ref(q, k, v, pos, cos, sin, kf, vf, slots)
    outs = []
    for write in (rope_kv_write_ref, rope_kv_write_triton):
        k8, v8 = torch.zeros(cap, hkv, d, dtype=FP8), torch.zeros(cap, hkv, d, dtype=FP8)
        write(q, k, v, pos, cos, sin, k8, v8, slots)
        outs.append((k8.float(), v8.float()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[0][0], to_fp8(kf).float())
    assert outs[0][1][slots[0], 0, :4].tolist() == [448.0, -448.0, 448.0, 3.0]


def test_fp8_moves_and_capacity():
    kv = KVCache(2, 50, 2, 16, torch.float32, torch.device("cpu"), kv_dtype="fp8")
    assert kv.k.dtype == FP8 and kv.k_scale is None
    kv.k[:, 10:20] = to_fp8(torch.randn(2, 10, 2, 16))
    before = kv.k[:, 10:20].float()
    kv.move(10, 15, 10)  # overlapping ranges
    assert torch.equal(kv.k[:, 15:25].float(), before)
    ratio = (KVCache.bytes_per_token(30, 3, 64, torch.bfloat16)
             / KVCache.bytes_per_token(30, 3, 64, torch.bfloat16, kv_dtype="fp8"))
    assert ratio == 2.0


def test_engine_on_fp8_kv_agrees_with_the_float_cache(kv_engines):
    prompts = [[1] + [(13 * i + 7 * j) % 900 + 3 for j in range(20 + 11 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    ref = kv_engines("float32", kv_cache_tokens=2048).generate(prompts, params)
    got = kv_engines("fp8", kv_cache_tokens=2048).generate(prompts, params)
    same = sum(a == b for r, g in zip(ref, got, strict=True)
               for a, b in zip(r.output_ids, g.output_ids, strict=True))
    assert same / (24 * len(prompts)) > 0.6
    first = [abs(r.logprobs[0] - g.logprobs[0]) for r, g in zip(ref, got, strict=True)]
    assert max(first) < 0.2  # the first token sees only the e4m3 prompt K/V
    assert kv_engines("fp8", kv_cache_gib=0.01).runner.capacity == pytest.approx(
        4 * kv_engines("float32", kv_cache_gib=0.01).runner.capacity, rel=0.01)  # fp32 -> 1 byte


def test_fp8_kv_survives_moves_and_preemption(kv_engines):
    prompts = [[1] + [(7 * i + j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    sp = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True)
          for i in range(8)]
    roomy = kv_engines("fp8", kv_cache_tokens=4096).generate(prompts, sp)
    tight = kv_engines("fp8", kv_cache_tokens=160, max_batched_tokens=32, max_running=8,
                    default_predicted_len=2, kv_min_grow=2)
    out = tight.generate(prompts, sp)
    assert [s.output_ids for s in out] == [s.output_ids for s in roomy]
    stats = tight.stats()
    assert stats.moves + stats.grows_in_place > 0 and stats.preemptions > 0
