"""fp16 KV cache under a float32 model (--kv-cache-dtype float16, and what auto means for a
float32 model on the CPU kernels): half a float32 cache's bytes, rows rounded to nearest as they
are written; the engine on it against the float32 cache, through moves and preemption; refused
where the model does not run in float32 on a CPU. The kernels' own checks are in
test_kernel_decode_attention, test_kernel_prefill_attention and test_kernel_cpu (rope)."""

from __future__ import annotations

import pytest
import torch

from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.shared.config import EngineConfig
from pipellm.shared.sampling import SamplingParams


def test_fp16_cache_moves_and_bytes():
    kv = KVCache(2, 50, 2, 16, torch.float32, torch.device("cpu"), kv_dtype="float16")
    assert kv.k.dtype == kv.v.dtype == torch.float16 and kv.k_scale is None
    kv.k[:, 10:20] = torch.randn(2, 10, 2, 16).half()
    before = kv.k[:, 10:20].clone()
    kv.move(10, 15, 10)  # overlapping ranges
    assert torch.equal(kv.k[:, 15:25], before)
    ratio = (KVCache.bytes_per_token(30, 3, 64, torch.float32)
             / KVCache.bytes_per_token(30, 3, 64, torch.float32, kv_dtype="float16"))
    assert ratio == 2.0


def test_engine_on_fp16_kv_agrees_with_the_float32_cache(kv_engines):
    prompts = [[1] + [(13 * i + 7 * j) % 900 + 3 for j in range(20 + 11 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)
    ref_engine = kv_engines("float32", kv_cache_tokens=2048)
    engine = kv_engines("float16", kv_cache_tokens=2048)
    assert ref_engine.runner.kv.k.dtype == torch.float32
    assert engine.runner.kv.k.dtype == torch.float16
    ref, got = ref_engine.generate(prompts, params), engine.generate(prompts, params)
    same = sum(a == b for r, g in zip(ref, got, strict=True)
               for a, b in zip(r.output_ids, g.output_ids, strict=True))
    assert same / (24 * len(prompts)) > 0.9
    gaps = [abs(a - b) for r, g in zip(ref, got, strict=True)
            for a, b in zip(r.logprobs[:1], g.logprobs[:1], strict=True)]
    assert max(gaps) < 0.01  # the first token sees only the rounded prompt K/V
    assert kv_engines("float16", kv_cache_gib=0.01).runner.capacity == \
        pytest.approx(2 * kv_engines("float32", kv_cache_gib=0.01).runner.capacity,
                      rel=0.01)


def test_fp16_kv_survives_moves_and_preemption(kv_engines):
    prompts = [[1] + [(7 * i + j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    sp = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True)
          for i in range(8)]
    roomy = kv_engines("float16", kv_cache_tokens=4096).generate(prompts, sp)
    tight = kv_engines("float16", kv_cache_tokens=160, max_batched_tokens=32,
                    max_running=8, default_predicted_len=2, kv_min_grow=2)
    out = tight.generate(prompts, sp)
    assert [s.output_ids for s in out] == [s.output_ids for s in roomy]
    stats = tight.stats()
    assert stats.moves + stats.grows_in_place > 0 and stats.preemptions > 0


@pytest.mark.parametrize("dtype,kernels,want", [
    ("float32", "auto", "float16"), ("float32", "reference", "auto"), ("bfloat16", "auto", "auto"),
    ("float16", "auto", "auto")])
def test_auto_is_fp16_under_a_float32_model_on_the_cpu_kernels(dtype, kernels, want):
    """auto: fp16 where a float32 model generates on the CPU's own kernels (every head size:
    the generic decode attention widens fp16 rows with F16C too); the model's dtype where it
    runs in 16 bits, on the reference kernels, or pools."""
    from pipellm.services.compute.kv.element import kv_cache_dtype

    cpu = torch.device("cpu")
    assert kv_cache_dtype(EngineConfig(kernels=kernels), getattr(torch, dtype), cpu) == want
    assert kv_cache_dtype(EngineConfig(kv_cache_dtype="int8"), torch.float32, cpu) == "int8"
    assert kv_cache_dtype(EngineConfig(runner="pooling"), torch.float32, cpu) == "auto"


def test_fp16_and_float32_kv_need_a_float32_model(kv_engines):
    with pytest.raises(ValueError, match="float16 is for a model run in float32 on a CPU by its "
                                         "C.. or reference kernels; this one runs in bfloat16 on "
                                         "cpu with --kernels auto: use auto"):
        kv_engines("float16", dtype="bfloat16")
    with pytest.raises(ValueError, match="--kernels triton"):
        kv_engines("float16", kernels="triton")
    with pytest.raises(ValueError, match="float32 is for a float32 model; this one runs in "
                                         "bfloat16 on cpu"):
        kv_engines("float32", dtype="bfloat16")
    with pytest.raises(ValueError, match="auto, float32, float16, int8 or fp8"):
        EngineConfig(kv_cache_dtype="float64")
