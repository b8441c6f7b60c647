"""The engine on the demo model: sampling across batches, stop conditions, bad input, abort."""

from __future__ import annotations

import pytest

from pipellm.services.compute.backend import build_engine
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.sampling import InvalidParams, SamplingParams


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return build_engine(EngineConfig(model=str(demo_model_dir), device="cpu", kv_cache_tokens=4096,
                                     scheduler=SchedulerConfig(max_batched_tokens=64,
                                                               max_running=16)))


PROMPTS = [[1, 5, 9, 200], [1, 77], [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 400]]


def run(engine, prompts, params):
    seqs = engine.generate(prompts, params)
    assert engine.stats().reserved == 0
    return [s.output_ids for s in seqs]


def test_seeded_sampling_repeats_whatever_the_batch(engine):
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = run(engine, [PROMPTS[0]], sp)[0]
    other = SamplingParams(max_tokens=16, temperature=0.7, top_k=5, seed=7, ignore_eos=True)
    mixed = run(engine, PROMPTS, [sp, other, other])
    assert mixed[0] == alone
    different_seed = run(engine, [PROMPTS[0]], SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True))[0]
    assert different_seed != alone


def test_unseeded_sampling_varies_and_greedy_is_deterministic(engine):
    hot = SamplingParams(max_tokens=16, temperature=2.0, ignore_eos=True)
    assert run(engine, [PROMPTS[1]], hot) != run(engine, [PROMPTS[1]], hot)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tiny_top_k = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, ignore_eos=True)
    assert run(engine, PROMPTS, greedy) == run(engine, PROMPTS, tiny_top_k)


def test_logprobs_are_returned_per_token(engine):
    asked, not_asked = engine.generate([PROMPTS[0], PROMPTS[0]], [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert len(asked.logprobs) == 5 and all(lp < 0 for lp in asked.logprobs)
    assert asked.output_ids == not_asked.output_ids
    alone = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0,
                                                         ignore_eos=True))[0]
    assert alone.logprobs == [0.0] * 5  # nobody in its batches asked: not computed


def test_stop_token_ends_and_min_tokens_defers_it(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = run(engine, [PROMPTS[2]], greedy)[0]
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    seq = engine.generate([PROMPTS[2]], SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=(stop_tok,)))[0]
    assert seq.output_ids == ref[: first + 1] and seq.finish_reason == "stop"
    seq = engine.generate([PROMPTS[2]], SamplingParams(
        max_tokens=12, temperature=0, stop_token_ids=(stop_tok,), min_tokens=first + 2))[0]
    assert len(seq.output_ids) >= first + 2
    assert stop_tok not in seq.output_ids[: first + 2]


def test_bad_requests_are_refused_with_the_parameter_named(engine):
    sp = SamplingParams(max_tokens=4)
    cases = {"empty": [], "out of vocab": [1, 10**6], "negative": [-1]}
    for prompt in cases.values():
        with pytest.raises(InvalidParams) as e:
            engine.add_request(prompt, sp)
        assert e.value.param == "prompt"
    with pytest.raises(InvalidParams, match="context length"):
        engine.add_request([1] * engine.max_model_len, sp)
    with pytest.raises(InvalidParams) as e:
        SamplingParams(top_p=0)
    assert e.value.param == "top_p"
    assert run(engine, [PROMPTS[1]], SamplingParams(max_tokens=3))  # still serving


def test_abort_frees_kv(engine):
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().reserved > 0
    assert engine.abort(rid)
    assert engine.stats().reserved == 0 and not engine.has_work()
    assert not engine.abort(rid)


@pytest.mark.gpu
def test_cuda_reference_path_matches_cpu(demo_model_dir, engine):
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    cuda = build_engine(EngineConfig(model=str(demo_model_dir), device="cuda", dtype="float32",
                                     scheduler=SchedulerConfig(max_batched_tokens=64,
                                                               max_running=16),
                                     kv_cache_tokens=4096))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert run(cuda, PROMPTS, greedy) == run(engine, PROMPTS, greedy)
    assert run(cuda, PROMPTS, sp) == run(engine, PROMPTS, sp)


def test_seeded_output_survives_moves_and_preemption(demo_model_dir, engine):
    prompts = [[1] + [(7 * i + j) % 900 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    sp = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True)
          for i in range(8)]
    roomy = run(engine, prompts, sp)
    tight = build_engine(EngineConfig(
        model=str(demo_model_dir), device="cpu",
        scheduler=SchedulerConfig(max_batched_tokens=32, max_running=8, kv_min_grow=2),
        kv_cache_tokens=160, default_predicted_len=2))
    assert run(tight, prompts, sp) == roomy
    stats = tight.stats()
    assert stats.moves > 0 and stats.preemptions > 0


def test_max_tokens_none_runs_to_the_context(engine):
    (seq,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=None, temperature=0,
                                                          ignore_eos=True))
    assert seq.num_tokens == engine.max_model_len and seq.finish_reason == "length"
    assert seq.params.max_tokens == engine.max_model_len - len(PROMPTS[0])


def test_only_pooling_forwards_round_p_coarsely(engine, monkeypatch):
    """Generation steps keep the prefill attention's P fine (greedy answers and logprobs
    depend on it); a pooling forward on the same engine asks for coarse P
    (pipellm/kernels/prefill_attention.py)."""
    from pipellm.services.compute.model import llama

    asked, attend = [], llama.prefill_attention

    def spy(*args, coarse_p=False, **kwargs):
        asked.append(coarse_p)
        return attend(*args, coarse_p=coarse_p, **kwargs)

    monkeypatch.setattr(llama, "prefill_attention", spy)
    run(engine, PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert asked and not any(asked)
    asked.clear()
    engine.embed(PROMPTS)
    assert asked and all(asked)
