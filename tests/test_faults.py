"""Fault injection: kill -9 one service while requests stream; no request is lost or left hanging.

One stack (`pipellm up`, its own supervised redis-server) on the demo model. For each victim,
STREAMS streaming and BATCH non-streaming requests start; once every stream has text, the
victim is killed. Every request must then complete with exactly the text of an uninterrupted
run (greedy; the gateway resumes what a restart lost), within DEADLINE_S: here resuming is
always possible, so an error (event) fails the test too. After each round the server answers a
normal request. tests/test_gateway_resume.py covers the streams that cannot be resumed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import aiohttp
import pytest

from tests.stack import Stack
from tests.test_speculative import spec_metrics

MODEL = "demo-llama"
STREAMS, BATCH = 10, 2
MAX_TOKENS = 120
DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    # a small step budget: the requests take a few seconds, so the kill lands mid-stream
    s = Stack(demo_model_dir, "--max-batched-tokens", "32", "--max-running", "32",
              embedded_redis=True).start()
    yield s
    s.stop()


def body(i: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": f"Fault request {i} says", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}


GRAMMAR = "[a-z]+( [a-z]+)*"  # the demo model's noise, constrained: words of ASCII letters


def grammar_body(i: int, stream: bool) -> dict:
    return {**body(i, stream), "structured_outputs": {"regex": GRAMMAR}}


async def read_stream(session, url: str, payload: dict, progress: dict, i: int) -> dict:
    """{"id", "text", "finish", "error", "done"} of one SSE stream; progress[i] counts its
    chunks."""
    out = {"id": None, "text": "", "finish": None, "error": None, "done": False}
    async with session.post(url, json=payload) as r:
        if r.status != 200:
            return {**out, "error": (r.status, await r.text())}
        async for line in r.content:
            line = line.decode().strip()
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                elif chunk["choices"]:
                    out["id"] = chunk["id"]
                    out["text"] += chunk["choices"][0]["text"]
                    out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
                    progress[i] = progress.get(i, 0) + 1
    return out


async def read_whole(session, url: str, payload: dict) -> dict:
    async with session.post(url, json=payload) as r:
        data = await r.json()
        if r.status != 200:
            return {"text": "", "finish": None, "error": data, "done": True}
        c = data["choices"][0]
        return {"id": data["id"], "text": c["text"], "finish": c["finish_reason"], "error": None,
                "done": True}


async def run_round(stack: Stack, kill=None, make=body) -> tuple[list[dict], float]:
    """All requests (`make(i, stream)`) at once; `kill()` once every stream has output.
    (results, seconds)."""
    url = stack.url + "/v1/completions"
    progress: dict[int, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as s:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(read_stream(s, url, make(i, True), progress, i))
                 for i in range(STREAMS)]
        tasks += [asyncio.create_task(read_whole(s, url, make(STREAMS + i, False)))
                  for i in range(BATCH)]
        if kill is not None:
            while len(progress) < STREAMS:
                assert not any(t.done() for t in tasks[:STREAMS]), "a stream ended before the kill"
                await asyncio.sleep(0.02)
            kill()
        results = await asyncio.gather(*tasks)
        return results, time.monotonic() - t0


@pytest.fixture(scope="module")
def uninterrupted(stack):
    results, seconds = asyncio.run(run_round(stack))
    print(f"\nuninterrupted: all {len(results)} requests done in {seconds:.1f} s")
    assert all(r["error"] is None and r["finish"] == "length" for r in results), results
    return [r["text"] for r in results]


@pytest.mark.parametrize("victim", ["compute", "detokenizer", "tokenizer-0", "redis"])
def test_kill_during_streams_loses_nothing(stack, uninterrupted, victim):
    old = stack.pid(victim)
    results, seconds = asyncio.run(run_round(stack, lambda: os.kill(old, signal.SIGKILL)))
    print(f"\nkill -9 {victim}: all {len(results)} requests done in {seconds:.1f} s")
    assert seconds < DEADLINE_S
    # every request here can be resumed (what its client has is in the gateway), so each must
    # complete with exactly the uninterrupted text; an error (event) would fail this too
    for i, (r, want) in enumerate(zip(results, uninterrupted, strict=True)):
        assert r["error"] is None, (victim, i, r["error"])
        assert (r["text"], r["finish"], r["done"]) == (want, "length", True), (victim, i)
    deadline = time.monotonic() + 60
    while stack.pid(victim) == old or stack.get("/health")[0] != 200:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    code, answer = stack.post("/v1/completions", body(0, False))
    assert code == 200 and answer["choices"][0]["text"] == uninterrupted[0]


def test_kill_compute_mid_grammar_resumes_the_grammar(stack):
    """Constrained requests: compute's restart replays each choice's tokens into a fresh matcher,
    so the text is the uninterrupted run's and still matches the grammar."""
    want, _ = asyncio.run(run_round(stack, make=grammar_body))
    assert all(r["error"] is None and r["finish"] == "length" for r in want), want
    old = stack.pid("compute")
    results, _ = asyncio.run(run_round(stack, lambda: os.kill(old, signal.SIGKILL),
                                       grammar_body))
    for r, w in zip(results, want, strict=True):
        assert (r["error"], r["text"], r["finish"]) == (None, w["text"], "length")
        assert re.fullmatch(GRAMMAR + " ?", r["text"]), r["text"]


def test_kill_compute_while_speculating_resumes_token_exactly(demo_model_dir):
    """With n-gram speculation (every request speculating): compute's restart resumes each
    choice from its delivered tokens, and every text is the uninterrupted run's (which is
    plain decoding's: speculation changes no greedy token)."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "disable_by_batch_size": 64})
    s = Stack(demo_model_dir, "--max-batched-tokens", "32", "--max-running", "32",
              "--speculative-config", spec, embedded_redis=True).start()
    try:
        want, _ = asyncio.run(run_round(s))
        assert all(r["error"] is None and r["finish"] == "length" for r in want), want
        assert spec_metrics(s)["vllm:spec_decode_num_accepted_tokens_total"] > 0
        old = s.pid("compute")
        results, _ = asyncio.run(run_round(s, lambda: os.kill(old, signal.SIGKILL)))
        for r, w in zip(results, want, strict=True):
            assert (r["error"], r["text"], r["finish"]) == (None, w["text"], "length")
    finally:
        s.stop()
