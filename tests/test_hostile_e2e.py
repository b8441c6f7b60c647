"""Hostile input and overload against a real stack (`pipellm up`: real processes, real Redis):
every hostile class is a 4xx and the server answers normally afterwards with no service
restarted; 3x --max-pending at once gives only 200s and 429s; completions default to 16
tokens; the prompt cap; and (slow) a 10,000-case generated corpus with 0 answers >= 500."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import aiohttp
import pytest

from tests.hostile_cases import CHAT, COMPLETIONS, HOSTILE, generate
from tests.stack import Stack

MODEL = "demo-llama"
MAX_PENDING = 8
CONTEXT = 64  # a short context keeps "up to the context" (chat without max_tokens) cheap
SERVICES = ("compute", "detokenizer", "tokenizer-0", "gateway")
CORPUS, CORPUS_BUDGET_S = 10_000, 110  # the corpus must finish within the budget on 2 cores


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    s = Stack(demo_model_dir, "--served-model-name", MODEL, "--max-pending", str(MAX_PENDING),
              "--max-model-len", str(CONTEXT), "--max-prompt-bytes", "2000").start()
    s.pids = {name: s.pid(name) for name in SERVICES}
    yield s
    s.stop()


async def send(session, url: str, path: str, ctype: str | None, raw: bytes):
    """(status, body bytes) of one POST; no Content-Type header at all when ctype is None."""
    headers = {} if ctype is None else {"Content-Type": ctype}
    skip = ["Content-Type"] if ctype is None else []
    async with session.post(url + path, data=raw, headers=headers,
                            skip_auto_headers=skip) as r:
        return r.status, await r.read()


def run(coro):
    return asyncio.run(coro)


def assert_serves_normally(stack) -> None:
    """A plain request is answered right, and no service was restarted meanwhile."""
    status, body = stack.post(COMPLETIONS, {"prompt": "Hello", "max_tokens": 3,
                                            "ignore_eos": True, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    assert isinstance(body["choices"][0]["text"], str)
    assert {name: stack.pid(name) for name in SERVICES} == stack.pids, stack.logs()


def test_each_hostile_class_is_4xx_then_a_normal_request_works(stack):
    async def main():
        async with aiohttp.ClientSession() as session:
            return [await send(session, stack.url, *case[1:]) for case in HOSTILE]

    for case, (status, raw) in zip(HOSTILE, run(main()), strict=True):
        assert 400 <= status < 500, (case[0], status, raw[:300])
        assert json.loads(raw)["error"]["type"] == "invalid_request_error", raw[:300]
    assert_serves_normally(stack)


def test_overload_three_times_max_pending_gets_only_200_and_429(stack):
    n = 3 * MAX_PENDING

    async def one(session, i: int):
        body = {"prompt": f"burst {i}", "max_tokens": 40, "ignore_eos": True,
                "stream": i % 2 == 0}
        return i % 2 == 0, *await send(session, stack.url, COMPLETIONS, "application/json",
                                       json.dumps(body).encode())

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(n)))

    results = run(main())
    statuses = Counter(status for _, status, _ in results)
    assert set(statuses) <= {200, 429}, results
    assert statuses[200] >= MAX_PENDING and statuses[429] >= 1, statuses
    for streaming, status, raw in results:
        if status == 200 and streaming:
            assert raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
        elif status == 200:
            assert json.loads(raw)["usage"]["completion_tokens"] == 40
        else:
            assert json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    assert_serves_normally(stack)


def test_completions_default_to_16_tokens_chat_to_the_context(stack):
    status, body = stack.post(COMPLETIONS, {"prompt": "Once upon a time", "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 16, body
    assert body["choices"][0]["finish_reason"] == "length"
    status, body = stack.post(CHAT, {"messages": [{"role": "user", "content": "Hi"}],
                                     "ignore_eos": True})
    assert status == 200, body
    usage = body["usage"]
    assert usage["completion_tokens"] == CONTEXT - usage["prompt_tokens"] > 16, usage


def test_prompt_over_max_prompt_bytes_is_400(stack):
    for path, body in ((COMPLETIONS, {"prompt": "a" * 2001}),
                       (CHAT, {"messages": [{"role": "user", "content": "é" * 1001}]})):
        status, err = stack.post(path, body)
        assert status == 400 and err["error"]["code"] == "prompt_too_large", err
        assert "--max-prompt-bytes" in err["error"]["message"]
    assert_serves_normally(stack)


async def _corpus(url: str, cases, concurrency: int, deadline: float):
    """Send the cases, `concurrency` at a time; per class, a Counter of statuses (or the
    exception's name) and of streams that ended without [DONE]."""
    counts: dict[str, Counter] = {}
    queue = iter(cases)

    async def worker(session):
        for name, path, ctype, raw in queue:
            if time.monotonic() > deadline:
                return
            try:
                status, body = await send(session, url, path, ctype, raw)
                if status == 200 and body.startswith(b"data:") and not body.rstrip().endswith(
                        b"data: [DONE]"):
                    status = "stream without [DONE]"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                status = type(e).__name__
            counts.setdefault(name, Counter())[status] += 1

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return counts


@pytest.mark.slow
def test_generated_hostile_corpus_never_gets_a_5xx(stack):
    start = time.monotonic()
    counts = run(_corpus(stack.url, generate(CORPUS, seed=12), MAX_PENDING,
                         start + CORPUS_BUDGET_S))
    elapsed = time.monotonic() - start
    print(f"\n{CORPUS} hostile cases in {elapsed:.1f} s")
    for name, c in sorted(counts.items()):
        print(f"  {name:20s} {dict(sorted(c.items(), key=str))}")
    total = sum(sum(c.values()) for c in counts.values())
    bad = {name: {s: k for s, k in c.items() if not isinstance(s, int) or s >= 500}
           for name, c in counts.items()}
    assert total == CORPUS, f"only {total} cases within the {CORPUS_BUDGET_S} s budget"
    assert not any(bad.values()), bad
    assert_serves_normally(stack)
