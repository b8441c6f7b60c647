"""`--data-parallel-size 2`: two compute processes behind one gateway, tokenizer and
detokenizer (real processes, real Redis, the demo model on CPU): the greedy texts of one
compute, requests and tokens on both (per-engine metrics under vLLM's names), a skewed load
balanced by predicted KV demand (where round robin would pile it on one process), and a
kill -9 of one compute that loses no stream."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.stack import Stack
from tests.test_faults import body, run_round

MAX_TOKENS = 48


def short(i: int, stream: bool) -> dict:
    return {**body(i, stream), "max_tokens": MAX_TOKENS}

MODEL = "demo-llama"


def dp_stack(model_dir, *extra: str) -> Stack:
    return Stack(model_dir, "--data-parallel-size", "2", "--max-batched-tokens", "32",
                 "--max-running", "32", *extra, embedded_redis=True).start()


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    s = dp_stack(demo_model_dir)
    yield s
    s.stop()


def per_engine(stack: Stack, name: str) -> dict[str, float]:
    """{engine rank: value} of a per-engine metric, once compute published its stats."""
    _, text = stack.get("/metrics")
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def wait_for(stack: Stack, name: str, total: float) -> dict[str, float]:
    """per_engine(name) once its values sum to `total` (compute publishes every heartbeat)."""
    import time

    deadline = time.monotonic() + 10
    while sum((values := per_engine(stack, name)).values()) < total and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return values


def settled(stack: Stack, name: str) -> dict[str, float]:
    """per_engine(name) once two reads a heartbeat apart agree (earlier work published)."""
    import time

    last = None
    while (values := per_engine(stack, name)) != last:
        last = values
        time.sleep(0.6)
    return values


def test_two_compute_processes_give_one_computes_texts(stack, demo_model_dir):
    from services.compute.backend import build_engine
    from shared.config import EngineConfig
    from shared.sampling import SamplingParams
    from shared.tokenizer import decode, encode, load_tokenizer

    tok = load_tokenizer(demo_model_dir)
    one = build_engine(EngineConfig(model=str(demo_model_dir), device="cpu",
                                    kv_cache_tokens=4096))
    got, _ = asyncio.run(run_round(stack, make=short))
    prompts = [encode(tok, short(i, False)["prompt"]) for i in range(len(got))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = [decode(tok, s.output_ids) for s in one.generate(prompts, params)]
    assert [(r["error"], r["text"], r["finish"]) for r in got] == \
        [(None, w, "length") for w in want]
    requests = wait_for(stack, "pipellm_engine_requests_total", len(got))
    assert set(requests) == {"0", "1"} and min(requests.values()) > 0, requests
    running = per_engine(stack, "vllm:num_requests_running")
    assert set(running) == {"0", "1"}


def skewed_load(stack: Stack) -> dict[str, float]:
    """Four long (MAX_TOKENS) and four short (2 tokens) requests at once: each engine's output
    tokens."""
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    before = settled(stack, "pipellm_engine_tokens_total")

    def complete(i: int) -> None:
        client.completions.create(model=MODEL, prompt=f"Skewed request {i}",
                                  max_tokens=MAX_TOKENS if i % 2 == 0 else 2, temperature=0,
                                  extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(complete, range(8)))
    after = wait_for(stack, "pipellm_engine_tokens_total",
                     sum(before.values()) + 4 * MAX_TOKENS + 4 * 2)
    return {r: after[r] - before.get(r, 0) for r in after}


def test_predicted_load_balances_a_skewed_load(stack):
    """A burst of long and short requests, in whatever order the tokenizers get them: routing
    by predicted KV demand (prompt + the predicted length, which the first test's requests
    taught to be MAX_TOKENS, or max_tokens where smaller; every tokenizer counts what the
    others routed, tests/test_dispatch.py) puts two long ones on each engine, whatever the
    order. Round robin puts them where their arrival order falls (in turn: all four on one,
    192 against 8 tokens; tests/test_scale_sim.py measures the two policies in the
    simulator)."""
    balanced = skewed_load(stack)
    print(f"\noutput tokens per compute, predicted-load: {balanced}")
    assert max(balanced.values()) <= 1.5 * min(balanced.values()), balanced


def test_kill_one_compute_loses_no_stream(stack):
    want, _ = asyncio.run(run_round(stack, make=short))
    old = stack.pid("compute-1")
    results, _ = asyncio.run(run_round(stack, lambda: os.kill(old, signal.SIGKILL), short))
    for r, w in zip(results, want, strict=True):
        assert (r["error"], r["text"], r["finish"]) == (None, w["text"], "length")
    code, answer = stack.post("/v1/completions", short(0, False))
    assert code == 200 and answer["choices"][0]["text"] == want[0]["text"]
