"""Prefix caching on the demo model: outputs are token-exact with and without the cache (greedy
and seeded sampling), through hits, evictions, moves, preemption and the overlap schedule."""

from __future__ import annotations

import random
import time

import openai
import pytest

from pipellm.services.compute.backend import build_engine
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.stack import Stack

SYSTEM = [1] + [(13 * j) % 700 + 5 for j in range(40)]  # a shared system prompt


def engine(model_dir, caching: bool, **kw):
    base = dict(model=str(model_dir), device="cpu", max_batched_tokens=64, max_running=8,
                kv_cache_tokens=4096, enable_prefix_caching=caching)
    return build_engine(with_settings(EngineConfig(), **base | kw))


def params(i: int, greedy: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(max_tokens=10 + i % 7, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=10 + i % 7, temperature=1.0, top_p=0.9, seed=i,
                          ignore_eos=True)


def conversations(eng, rounds: int, chats: int, greedy: bool) -> list[list[list[int]]]:
    """`chats` multi-turn conversations (each opens with SYSTEM) run side by side for `rounds`
    turns: each turn's prompt is the previous prompt, its answer and a new question."""
    rng = random.Random(0)
    prompts = [SYSTEM + [rng.randrange(3, 900) for _ in range(rng.randint(2, 12))]
               for _ in range(chats)]
    outputs = []
    for r in range(rounds):
        seqs = eng.generate(prompts, [params(r * chats + c, greedy) for c in range(chats)])
        outputs.append([s.output_ids for s in seqs])
        prompts = [p + s.output_ids + [rng.randrange(3, 900) for _ in range(rng.randint(2, 9))]
                   for p, s in zip(prompts, seqs, strict=True)]
    return outputs


@pytest.mark.parametrize("greedy", [True, False])
def test_multi_turn_outputs_are_identical_with_the_cache(demo_model_dir, greedy):
    plain = conversations(engine(demo_model_dir, False), 4, 5, greedy)
    cached_engine = engine(demo_model_dir, True)
    assert conversations(cached_engine, 4, 5, greedy) == plain
    stats = cached_engine.stats()
    # every prompt after the very first ones starts with a cached prefix
    assert stats.prefix_hits > 0.6 * stats.prefix_queries
    assert stats.reserved == 0 and stats.prefix_cached > 0


def test_identical_through_evictions_moves_and_preemption(demo_model_dir):
    roomy = conversations(engine(demo_model_dir, False), 3, 6, greedy=False)
    tight = engine(demo_model_dir, True, kv_cache_tokens=400, max_batched_tokens=32,
                   default_predicted_len=2, kv_min_grow=2)
    assert conversations(tight, 3, 6, greedy=False) == roomy
    stats = tight.stats()
    assert stats.prefix_hits > 0 and stats.prefix_evictions > 0
    assert stats.moves > 0 and stats.preemptions > 0
    tight.kv.allocator.check()


def test_identical_with_the_overlap_schedule(demo_model_dir):
    """A request finishing while its next step is in flight is cached with the K/V that step
    writes: a later hit copies it after that step has run."""
    plain = conversations(engine(demo_model_dir, False), 3, 4, greedy=True)
    overlapped = engine(demo_model_dir, True, overlap_schedule="on")
    assert conversations(overlapped, 3, 4, greedy=True) == plain
    assert overlapped.stats().prefix_hits > 0


def test_usage_counts_the_cached_prompt_tokens(demo_model_dir):
    eng = engine(demo_model_dir, True)
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = eng.generate([SYSTEM + [7, 8]], sp)[0]
    second = eng.generate([SYSTEM + [9]], sp)[0]
    assert first.cached_tokens == 0 and second.cached_tokens == len(SYSTEM)


def test_paged_policy_refuses_prefix_caching():
    with pytest.raises(ValueError, match="prefix-caching"):
        build_engine(EngineConfig(backend="sim", scheduler=SchedulerConfig(
            kv_policy="paged", enable_prefix_caching=True)))


def test_served_with_the_cache_usage_and_metrics_report_it(demo_model_dir):
    """Through the real services and the official client: the second request with the same
    long system message reports cached prompt tokens (streamed and not), its output equals the
    first's (computed without a hit), and /metrics counts the hits."""
    system = "You are a helpful assistant. " * 30
    ask = [dict(role="system", content=system), dict(role="user", content="Hello there")]
    stack = Stack(demo_model_dir, "--served-model-name", "demo", "--enable-prefix-caching")
    stack.start()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="demo", messages=ask, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
        first = client.chat.completions.create(**kw)
        second = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}))
        deadline = time.monotonic() + 10  # compute publishes its stats every heartbeat
        while ((stats := stack.engine_stats())["pipellm_prefix_cache_queries_total"] <
               3 * first.usage.prompt_tokens or running(text := stack.get("/metrics")[1])) \
                and time.monotonic() < deadline:  # all three counted, none running any more
            time.sleep(0.1)
    finally:
        stack.stop()
    check_vllm_metrics(text, stats, "demo", requests=3)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = first.usage.prompt_tokens
    assert n - 2 <= second.usage.prompt_tokens_details.cached_tokens < n  # all but the last
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == \
        second.usage.prompt_tokens_details.cached_tokens
    text = first.choices[0].message.content
    assert second.choices[0].message.content == text
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert stats["pipellm_prefix_cache_hits_total"] == \
        2 * second.usage.prompt_tokens_details.cached_tokens
    assert stats["pipellm_prefix_cache_queries_total"] == 3 * n
    assert stats["pipellm_prefix_cache_hit_rate"] > 0.6
    assert stats["pipellm_prefix_cache_cached_tokens"] >= n


def running(text: str) -> float:
    """Requests running, over the engines, in a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running")


def check_vllm_metrics(text: str, stats: dict[str, float], model: str, requests: int) -> None:
    """/metrics parses as Prometheus text and carries vLLM's names beside pipellm's, with the
    same figures: what routers and the Kubernetes inference gateway read."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    engine = (("engine", "0"), ("model_name", model))
    assert samples[("vllm:num_requests_running", engine)] == 0
    assert samples[("vllm:num_requests_waiting", engine)] == 0
    assert 0 <= samples[("vllm:kv_cache_usage_perc", engine)] <= 1
    [info] = [labels for name, labels in samples if name == "vllm:cache_config_info"]
    assert dict(info)["block_size"] == "16" and dict(info)["enable_prefix_caching"] == "True"
    model_label = (("model_name", model),)
    assert samples[("vllm:prefix_cache_hits_total", model_label)] == \
        stats["pipellm_prefix_cache_hits_total"]
    assert samples[("vllm:prefix_cache_queries_total", model_label)] == \
        stats["pipellm_prefix_cache_queries_total"]
    assert samples[("vllm:time_to_first_token_seconds_count", model_label)] == requests
    assert samples[("vllm:e2e_request_latency_seconds_count", model_label)] == requests
    assert samples[("vllm:generation_tokens_total", model_label)] > 0
