"""A streaming client for OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

Requests are what `vllm bench serve` sends: `stream: true` with `stream_options.include_usage`,
`max_tokens` (chat: `max_completion_tokens`) = the item's output length, `ignore_eos` when
asked, plus extra sampling fields. Every SSE chunk that carries a choice is timestamped (the
first one gives TTFT, later ones the inter-token gaps). Output tokens come from the final usage
chunk's `completion_tokens`, else the number of choice-carrying chunks; the prompt length from
its `prompt_tokens`, else the workload's estimate. A request succeeds when its stream answered
200 and carried at least one choice without an error object.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import aiohttp

from pipellm.loadgen.metrics import RequestRecord

TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests."""

    base_url: str
    path: str = "/v1/completions"
    model: str = ""
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)  # e.g. {"temperature": 0}

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.path

    @property
    def chat(self) -> bool:
        return self.path.rstrip("/").endswith("chat/completions")


def headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def payload(ep: Endpoint, prompt: str, max_tokens: int, stream: bool = True,
            priority: int | None = None) -> dict:
    """The request body for `prompt` (chat: one user message); `priority` (vLLM's field:
    lower runs first) only when given."""
    body: dict = {"model": ep.model, "stream": stream}
    if ep.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ep.ignore_eos:
        body["ignore_eos"] = True
    if priority is not None:
        body["priority"] = priority
    body.update(ep.extra_body)
    return body


def session() -> aiohttp.ClientSession:
    """A session without a connection cap (concurrency is the runner's job)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=TIMEOUT,
                                 headers=headers())


async def first_model(s: aiohttp.ClientSession, base_url: str) -> tuple[str, int | None]:
    """(id, max_model_len or None) of the first model in GET /v1/models."""
    async with s.get(base_url.rstrip("/") + "/v1/models") as r:
        r.raise_for_status()
        data = (await r.json())["data"]
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]["id"], data[0].get("max_model_len")


async def prompt_tokens(s: aiohttp.ClientSession, ep: Endpoint, prompt: str) -> int | None:
    """The server's `usage.prompt_tokens` for `prompt` (a 1-token, non-streamed request)."""
    async with s.post(ep.url, json=payload(ep, prompt, 1, stream=False)) as r:
        if r.status != 200:
            return None
        usage = (await r.json()).get("usage") or {}
    return usage.get("prompt_tokens")


async def send(s: aiohttp.ClientSession, ep: Endpoint, prompt: str, prompt_len: int,
               max_tokens: int, priority: int | None = None) -> RequestRecord:
    """Send one streamed request; never raises for HTTP or stream errors (they are recorded)."""
    rec = RequestRecord(prompt_len=prompt_len, expected_output_len=max_tokens)
    rec.start_time = start = time.perf_counter()
    chunks = 0
    text: list[str] = []
    try:
        async with s.post(ep.url, json=payload(ep, prompt, max_tokens,
                                                priority=priority)) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return rec
            last = start
            async for chunk in _events(r):
                now = time.perf_counter()
                if chunk.get("error"):
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return rec
                if chunk.get("choices"):
                    if chunks == 0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    text.append(_text(chunk["choices"][0], ep.chat))
                _usage(rec, chunk.get("usage"))
            rec.latency = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.generated_text = "".join(text)
    rec.output_tokens = rec.output_tokens or chunks
    rec.success = chunks > 0
    if not rec.success:
        rec.error = "the stream carried no output"
    return rec


async def _events(r: aiohttp.ClientResponse):
    """The JSON objects of an SSE stream's `data:` lines, up to `[DONE]`."""
    async for raw in r.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _text(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _usage(rec: RequestRecord, usage: dict | None) -> None:
    if not usage:
        return
    if usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        rec.prompt_len = int(usage["prompt_tokens"])
