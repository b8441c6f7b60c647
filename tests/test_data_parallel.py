"""`--data-parallel-size 2`: two compute processes behind one gateway, tokenizer and
detokenizer (real processes, real Redis, the demo model on CPU): the greedy texts of one
compute, requests and tokens on both (per-engine metrics under vLLM's names), a skewed load
balanced by predicted KV demand (where round robin would pile it on one process), a kill -9 of
one compute that loses no stream and resumes only its own, and (prefix caching on: routing is
predicted-load-affinity) a conversation kept with the compute that holds its prefix."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

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
    return Stack(model_dir, "--data-parallel-size", "2", "--max-running", "32",
                 "--kv-cache-tokens", "40000", "--enable-prefix-caching", *extra,
                 embedded_redis=True).start()


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    s = dp_stack(demo_model_dir)
    # /health is green once one compute serves: wait for the other (its first stats)
    deadline = time.monotonic() + 60
    while set(per_engine(s, "vllm:num_requests_running")) != {"0", "1"}:
        assert time.monotonic() < deadline, s.logs()
        time.sleep(0.1)
    yield s
    s.stop()


def per_engine(stack: Stack, name: str) -> dict[str, float]:
    """{engine rank: value} of a per-engine metric, once compute published its stats."""
    _, text = stack.get("/metrics")
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def wait_for(stack: Stack, name: str, total: float) -> dict[str, float]:
    """per_engine(name) once its values sum to `total` (compute publishes every heartbeat)."""
    deadline = time.monotonic() + 10
    while sum((values := per_engine(stack, name)).values()) < total and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    return values


def settled(stack: Stack, name: str) -> dict[str, float]:
    """per_engine(name) once two reads a heartbeat apart agree (earlier work published)."""
    last = None
    while (values := per_engine(stack, name)) != last:
        last = values
        time.sleep(0.6)
    return values


def test_two_compute_processes_give_one_computes_texts(stack, demo_model_dir):
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.sampling import SamplingParams
    from pipellm.shared.tokenizer import decode, encode, load_tokenizer

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
    """Every stream completes with its text (each request's state counts where the tokenizers
    routed it: `routed_<rank>`)."""
    want, _ = asyncio.run(run_round(stack, make=short))
    old = stack.pid("compute-1")
    results, _ = asyncio.run(run_round(stack, lambda: os.kill(old, signal.SIGKILL), short))
    for r, w in zip(results, want, strict=True):
        assert (r["error"], r["text"], r["finish"]) == (None, w["text"], "length")
    routed = [routes(stack, r["id"]) for r in results]
    assert all(sum(r) in (1, 2) for r in routed) and any(sum(r) == 2 for r in routed), routed
    code, answer = stack.post("/v1/completions", short(0, False))
    assert code == 200 and answer["choices"][0]["text"] == want[0]["text"]


def routes(stack: Stack, request_id: str) -> tuple[int, int]:
    """How many times the tokenizers routed a request to compute 0 and to compute 1."""
    _, got = stack.get(f"/v1/requests/{request_id}")
    return int(got.get("routed_0", 0)), int(got.get("routed_1", 0))


def resumes(stack: Stack) -> int:
    """The gateway's restart resumes so far, as its log says."""
    return Path(stack.run_dir, "up.log").read_text(errors="replace").count("restarted; resum")


def test_a_restarted_compute_resumes_only_its_own_streams(stack):
    """A stream on one compute while the other is killed and restarts: it is not resumed
    (routed once), and completes. Its compute is paused (SIGSTOP) until the gateway has seen
    the restart, so the stream is in flight then on a machine of any speed."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    chunks = iter(client.completions.create(
        model=MODEL, prompt="A long one", max_tokens=1000, n=16, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    first = next(chunks)
    rank = routes(stack, first.id).index(1)
    restarts = resumes(stack)
    survivor = stack.pid(f"compute-{rank}")
    os.kill(survivor, signal.SIGSTOP)
    try:
        os.kill(stack.pid(f"compute-{1 - rank}"), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while resumes(stack) == restarts:  # until the gateway saw the restart
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.05)
        assert stack.get(f"/v1/requests/{first.id}")[1]["status"] != "finished"
    finally:
        os.kill(survivor, signal.SIGCONT)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finish == ["length"] * 16
    assert routes(stack, first.id) == ((1, 0) if rank == 0 else (0, 1))  # never resumed


CONVERSATION = ("The ship's log, day one: we left the harbour at dawn with a light wind from the "
                "west, twelve crew aboard and supplies for a month. The navigator asks: ")


def test_a_conversation_stays_with_its_compute_under_load(stack):
    """With prefix caching, routing is predicted-load-affinity: a conversation's next turn goes
    to the compute holding its prefix (and hits its prefix cache) even while a long request of
    the same conversation makes that compute the busier one; an unrelated request meanwhile goes
    to the other, the less loaded."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    deadline = time.monotonic() + 10  # the earlier tests' requests gone from the published stats
    while sum(per_engine(stack, "vllm:num_requests_running").values()) or \
            sum(per_engine(stack, "pipellm_engine_demand").values()):
        assert time.monotonic() < deadline
        time.sleep(0.05)

    def complete(prompt: str, **kw):
        return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)

    prompt = CONVERSATION + "which course?"
    first = complete(prompt, max_tokens=8)
    home = routes(stack, first.id).index(1)
    prompt += first.choices[0].text + " And the wind?"
    busy = iter(complete(prompt + " Recite the log.", max_tokens=300, stream=True,
                         extra_body={"ignore_eos": True}))
    assert routes(stack, next(busy).id)[home] == 1
    turn = complete(prompt, max_tokens=8)
    assert routes(stack, turn.id)[home] == 1, "the next turn left its compute"
    assert turn.usage.prompt_tokens_details.cached_tokens >= 16
    fresh = complete("Unrelated: apples grow on", max_tokens=4)
    assert routes(stack, fresh.id)[1 - home] == 1, "load did not send it to the other"
    assert [c.choices[0].finish_reason for c in busy][-1] == "length"
