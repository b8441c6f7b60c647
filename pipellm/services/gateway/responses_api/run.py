"""Running one response: its deltas through ResponseOutput, answered whole, as SSE, or (in the
background) written to the store as they come.

`Run` is one response being generated; `collect`, `stream` and `background` are its three ways
of being answered. A stored response is written once its output is complete (background ones
also delta by delta, so that a poller or a reattached stream sees them and a restarted gateway
can continue them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web

from pipellm.services.gateway import responses
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.inflight import ChoiceState, Inflight
from pipellm.services.gateway.protocol import GenerationRequest
from pipellm.services.gateway.responses_api.output import ResponseOutput, logprobs_of, usage
from pipellm.services.gateway.responses_api.request import Parsed
from pipellm.services.gateway.responses_api.store import ResponseStore
from pipellm.services.gateway.stream import deltas
from pipellm.shared.tokenizer import encode


def sse(event: dict) -> bytes:
    """`event: <type>\\ndata: <json>\\n\\n`."""
    return responses.sse(event, event["type"])


def new_object(response_id: str, model: str, echo: dict, status: str) -> dict:
    """A Response object before its output."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "status": status, "model": model, "output": [], "error": None,
            "incomplete_details": None, "usage": None, **echo}


def delta_record(req: GenerationRequest, delta, entries) -> dict:
    """What a delta adds to a response's output (a background response's stored record)."""
    return {"r": delta.reasoning if req.shows_reasoning else "", "t": delta.text,
            "ids": list(delta.token_ids), "lp": logprobs_of(entries) if req.logprobs else None,
            "last": delta.finish_reason is not None}


def feed(out: ResponseOutput, record: dict) -> list[dict]:
    return out.feed(record["r"], record["t"], record["lp"], record["last"])


def end_record(tokenizer, c: ChoiceState) -> dict:
    """How a finished choice ends its response: its status and usage (the reasoning's tokens
    counted by tokenizing its text)."""
    reasoning = "".join(c.reasoning)
    n_reasoning = len(encode(tokenizer, reasoning, add_special_tokens=False)) \
        if reasoning else 0
    return {"end": "incomplete" if c.finish_reason == "length" else "completed",
            "usage": usage(c.num_prompt, len(c.token_ids), c.cached_tokens,
                           min(n_reasoning, len(c.token_ids)))}


CANCEL_STATUS = 499  # the error a cancelled background response's queue gets (Jobs.cancel)
CANCELLED = {"end": "cancelled", "usage": None}


def failed_record(e: APIError) -> dict:
    """How an error ends its response (response.failed)."""
    return {"end": "failed", "usage": None, "error": {"code": e.type, "message": e.message}}


def whole_response(tokenizer, parsed: Parsed, response_id: str,
                   choices: list[ChoiceState]) -> dict:
    """The Response object of a finished request (one choice), without HTTP (run-batch)."""
    c = choices[0]
    out = ResponseOutput(parsed.req, new_object(response_id, parsed.req.model, parsed.echo,
                                                "in_progress"))
    lp = logprobs_of(c.logprobs) if parsed.req.logprobs else None
    out.feed("".join(c.reasoning) if parsed.req.shows_reasoning else "", "".join(c.text), lp,
             last=True)
    end = end_record(tokenizer, c)
    out.finish(end["end"], end["usage"])
    return out.obj


@dataclass
class Run:
    """A response being generated: its request, its output so far, and its store."""

    gw: object
    parsed: Parsed
    obj: dict
    store: ResponseStore
    request_record: dict  # body, history, seed: what makes it again
    out: ResponseOutput = field(init=False)

    def __post_init__(self):
        self.out = ResponseOutput(self.parsed.req, self.obj)

    @property
    def req(self) -> GenerationRequest:
        return self.parsed.req

    def end_record(self, inflight: Inflight) -> dict:
        return end_record(self.gw.tokenizer, inflight.choices[0])

    def finish(self, end: dict) -> list[dict]:
        return self.out.finish(end["end"], end["usage"], end.get("error"))

    async def save(self) -> None:
        if self.parsed.store:
            stored = await self.store.save(self.obj, self.request_record,
                                           self.parsed.input_items)
            self.obj["store"] = stored

    async def collect(self, gw, req: GenerationRequest, inflight: Inflight) -> web.Response:
        async for _c, delta, entries in deltas(gw, req, inflight):
            feed(self.out, delta_record(req, delta, entries))
        self.finish(self.end_record(inflight))
        await self.save()
        return web.json_response(self.obj)

    async def stream(self, gw, request: web.Request, req: GenerationRequest,
                     inflight: Inflight) -> web.StreamResponse:
        """The SSE answer; an error after the first event is a response.failed event."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        started = False
        try:
            async for _c, delta, entries in deltas(gw, req, inflight):
                events = [] if started else self.out.start()
                if not started:
                    await resp.prepare(request)
                    started = True
                for event in events + feed(self.out, delta_record(req, delta, entries)):
                    await resp.write(sse(event))
            events = self.finish(self.end_record(inflight))
            await self.save()
        except APIError as e:
            if not started:
                raise
            events = self.finish(failed_record(e))
        for event in events:
            await resp.write(sse(event))
        await resp.write_eof()
        return resp

    async def background(self, inflight: Inflight) -> None:
        """Generate to the end, writing each delta's record; the end record last."""
        rid = self.obj["id"]
        try:
            async for _c, delta, entries in deltas(self.gw, self.req, inflight):
                record = delta_record(self.req, delta, entries)
                await self.store.push(rid, record)
                feed(self.out, record)
            end = self.end_record(inflight)
        except APIError as e:
            end = CANCELLED if e.status == CANCEL_STATUS else failed_record(e)
        except asyncio.CancelledError:
            end = CANCELLED
        self.finish(end)
        await self.store.push(rid, end)
        await self.save()
