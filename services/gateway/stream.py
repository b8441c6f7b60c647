"""Turning a request's Deltas into an HTTP answer: one JSON response, or an SSE stream.

The stream's headers go out with the first delta, so an error that comes before any output
(template failure, prompt too long, a service restart) is still a plain JSON error response.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from services.gateway import responses
from services.gateway.errors import APIError
from services.gateway.inflight import Inflight
from services.gateway.protocol import GenerationRequest
from shared.messages import Delta


@dataclass
class ChoiceState:
    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt: int = 0
    last: float = 0.0  # monotonic time of the last delta, for inter-token latency
    sent_role: bool = False


async def _deltas(gw, req: GenerationRequest, inflight: Inflight, choices: list[ChoiceState]):
    """Yield (choice, delta) until every choice finished; raise APIError on an error delta."""
    open_choices = len(choices)
    while open_choices:
        delta: Delta = await inflight.deltas.get()
        if delta.error is not None:
            gw.metrics.requests.labels("failed").inc()
            raise APIError(delta.error_status or 500, delta.error)
        c = choices[int(delta.request_id.rsplit(":", 1)[1])]
        _observe(gw, inflight, c, delta)
        c.text.append(delta.text)
        c.token_ids.extend(delta.token_ids)
        c.logprobs.extend(delta.logprobs)
        c.num_prompt = delta.num_prompt
        if delta.finish_reason is not None:
            c.finish_reason = delta.finish_reason
            open_choices -= 1
        yield c, delta
    gw.metrics.requests.labels("finished").inc()
    gw.metrics.e2e.observe(time.monotonic() - inflight.start)


def _observe(gw, inflight: Inflight, c: ChoiceState, delta: Delta) -> None:
    now = time.monotonic()
    m = gw.metrics
    if not c.token_ids:
        m.ttft.observe(now - inflight.start)
        if delta.started_at:
            m.queue.observe(max(delta.started_at - inflight.arrival, 0.0))
    else:
        m.itl.observe(now - c.last)
    c.last = now
    m.tokens.inc(len(delta.token_ids))


def _usage(choices: list[ChoiceState]) -> responses.Usage:
    return responses.Usage(choices[0].num_prompt, sum(len(c.token_ids) for c in choices))


def _token_strings(gw, ids) -> list[str]:
    return [gw.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


async def collect(gw, req: GenerationRequest, inflight: Inflight,
                  choices: list[ChoiceState]) -> web.Response:
    async for _ in _deltas(gw, req, inflight, choices):
        pass
    out = [responses.Choice(
        c.index, "".join(c.text), c.finish_reason, c.token_ids,
        c.logprobs if req.logprobs else None,
        _token_strings(gw, c.token_ids) if req.logprobs else None) for c in choices]
    build = responses.chat_response if req.kind == "chat" else responses.completion_response
    return web.json_response(build(inflight.request_id, req.model, int(time.time()), out,
                                   _usage(choices)))


async def stream(gw, request: web.Request, req: GenerationRequest, inflight: Inflight,
                 choices: list[ChoiceState]) -> web.StreamResponse:
    resp: web.StreamResponse | None = None
    created = int(time.time())
    sent_chars = [0] * len(choices)
    async for c, delta in _deltas(gw, req, inflight, choices):
        if resp is None:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
        lp = None
        if req.logprobs:
            toks = _token_strings(gw, delta.token_ids)
            lp = (responses.chat_logprobs(toks, list(delta.logprobs)) if req.kind == "chat"
                  else responses.completion_logprobs(toks, list(delta.logprobs),
                                                     sent_chars[c.index]))
        sent_chars[c.index] += len(delta.text)
        await resp.write(responses.sse(_chunk(req, inflight, created, c, delta, lp)))
    if req.include_usage:
        await resp.write(responses.sse(responses.usage_chunk(
            req.kind, inflight.request_id, req.model, created, _usage(choices))))
    await resp.write(responses.SSE_DONE)
    await resp.write_eof()
    return resp


def _chunk(req: GenerationRequest, inflight: Inflight, created: int, c: ChoiceState,
           delta: Delta, lp: dict | None) -> dict:
    if req.kind == "chat":
        role = None if c.sent_role else "assistant"
        c.sent_role = True
        return responses.chat_chunk(inflight.request_id, req.model, created, c.index,
                                    delta.text, role, delta.finish_reason, lp,
                                    include_usage=req.include_usage)
    return responses.completion_chunk(inflight.request_id, req.model, created, c.index,
                                      delta.text, delta.finish_reason, lp,
                                      include_usage=req.include_usage)
