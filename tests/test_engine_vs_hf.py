"""Token-exact greedy equality with HF transformers `generate` on tiny random models.

Requests arrive at different steps, the token budget is small (chunked prefill and merged
prefill+decode steps happen), and in the second variant the KV pool is so small that segments
are moved and requests preempted. The output must not change.
"""

from __future__ import annotations

import random

import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.engine import LLMEngine
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings

NUM_PROMPTS = 16
MAX_NEW = 24


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [1, 2, 300, 7, 64, 129, 33, 250, 5, 90, 17, 200, 3, 45, 120, 11]
    assert len(lens) == NUM_PROMPTS
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
        assert len(outs[-1]) == max_new
    return outs


def run_staggered(engine: LLMEngine, prompts, params, arrive_every: int = 2):
    """Add 4 requests up front, then one every `arrive_every` steps; run to completion."""
    rids, queue, step = [], list(prompts), 0
    while queue or engine.has_work():
        if len(rids) < 4 or step % arrive_every == 0:
            if queue:
                rids.append(engine.add_request(queue.pop(0), params))
        engine.step()
        engine.kv.allocator.check()
        step += 1
    return rids


def engine_greedy(model_dir, prompts, max_new: int = MAX_NEW, **cfg
                  ) -> tuple[list[list[int]], LLMEngine]:
    """Greedy continuations of `prompts` (max_new tokens each) through an engine built with the
    settings `cfg`, requests arriving staggered (`run_staggered`)."""
    config = with_settings(EngineConfig(), model=str(model_dir), device="cpu", dtype="float32",
                           **{"kv_cache_dtype": "float32", **cfg})
    engine = build_engine(config)
    outputs: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    orig_step = engine.step

    def step():
        result = orig_step()
        for ev in result.outputs:
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
        return result

    engine.step = step
    rids = run_staggered(engine, prompts, params)
    return [outputs[r] for r in rids], engine


ARCHS = [
    ("llama", {"num_key_value_heads": 2}),
    ("qwen2", {"num_key_value_heads": 2}),
]


@pytest.fixture(scope="module", params=ARCHS, ids=[a for a, _ in ARCHS])
def reference(request, tmp_path_factory):
    from tests.hf_models import build_hf_model

    arch, overrides = request.param
    path = tmp_path_factory.mktemp(arch)
    model = build_hf_model(path, arch, initializer_range=0.1, **overrides)
    prompts = make_prompts(model.config.vocab_size)
    return path, prompts, hf_greedy(model, prompts, MAX_NEW)


def test_greedy_matches_hf_with_chunked_prefill(reference):
    path, prompts, expected = reference
    got, engine = engine_greedy(path, prompts, max_batched_tokens=48, max_running=16,
                                kv_cache_tokens=8192)
    assert got == expected
    assert engine.stats().reserved == 0  # every segment was freed


def test_greedy_matches_hf_under_moves_and_preemption(reference):
    path, prompts, expected = reference
    # 360 slots: the 300-token prompt fits alone, but not beside the others. Predicted length 2
    # forces segments to grow every few tokens: in place, by moving, or by preempting.
    got, engine = engine_greedy(path, prompts, max_batched_tokens=48, max_running=16,
                                kv_cache_tokens=360, default_predicted_len=2, kv_min_grow=4)
    stats = engine.stats()
    assert stats.moves > 0 and stats.preemptions > 0 and stats.grows_in_place > 0
    assert got == expected


VARIANTS = {
    "llama-mqa-llama3rope-tied": ("llama", {
        "num_key_value_heads": 1, "tie_word_embeddings": True, "max_position_embeddings": 1024,
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    }),
    "llama-linear-rope-mha": ("llama", {
        "num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }),
    "mistral": ("mistral", {"sliding_window": None, "head_dim": 32}),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_architecture_variants_match_hf(name, tmp_path):
    from tests.hf_models import build_hf_model

    arch, overrides = VARIANTS[name]
    model = build_hf_model(tmp_path, arch, initializer_range=0.1, **overrides)
    prompts = make_prompts(model.config.vocab_size, seed=1)[::4]  # lengths 1, 64, 90, 3
    expected = hf_greedy(model, prompts, 12)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32",
                          scheduler=SchedulerConfig(max_batched_tokens=40, max_running=8),
                          kv_cache_tokens=2048, kv_cache_dtype="float32")
    seqs = build_engine(config).generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                              ignore_eos=True))
    assert [s.output_ids for s in seqs] == expected


def test_triton_kernels_give_the_reference_tokens(tmp_path):
    """The whole model on the Triton kernels (CPU interpreter) vs the PyTorch reference path."""
    from pipellm.kernels.dispatch import set_backend
    from tests.hf_models import build_hf_model

    build_hf_model(tmp_path, "llama", initializer_range=0.1, num_key_value_heads=1)
    prompts = [[5, 6, 7], list(range(3, 40)), [9]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    try:
        for backend in ("reference", "triton"):
            config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32",
                                  scheduler=SchedulerConfig(max_batched_tokens=16, max_running=4),
                                  kv_cache_tokens=256, kernels=backend)
            seqs = build_engine(config).generate(prompts, params)
            outputs[backend] = [s.output_ids for s in seqs]
    finally:
        set_backend("auto")
    assert outputs["triton"] == outputs["reference"]
