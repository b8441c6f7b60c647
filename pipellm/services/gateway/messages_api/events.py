"""The streamed message: Anthropic's SSE events, built from a request's Deltas.

    message_start (the message, content empty, usage so far)   ping
    per content block, numbered 0, 1, ... in order:
        content_block_start    content_block_delta (text_delta | thinking_delta |
        input_json_delta; a thinking block's signature_delta last)    content_block_stop
    message_delta (stop_reason, stop_sequence, usage)   message_stop

Invariants: at most one block is open, and it is stopped before the next starts and before
message_delta; a tool_use block's partial_json pieces concatenate to its input's JSON; the
blocks' texts and inputs are those of the non-streamed answer (answer.message). Everything
goes out only once the first delta came (an error before it is a plain JSON error); an error
after that is an `error` event, then the stream ends: never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from pipellm.services.gateway import responses
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.inflight import ChoiceState, Inflight
from pipellm.services.gateway.messages_api.answer import (
    error_body,
    message,
    message_id,
    stop_fields,
    tool_use_id,
    usage,
)
from pipellm.services.gateway.protocol import GenerationRequest
from pipellm.services.gateway.stream import Answer, collector, deltas
from pipellm.services.gateway.tool_parsers import CallArgs, CallStart, Content
from pipellm.shared.messages import Delta

PING_S = 15.0  # a ping goes out after this long without an event
Event = tuple[str, dict]  # (event type, data)


def sse(event: Event) -> bytes:
    """`event: <type>\\ndata: <json>\\n\\n`."""
    kind, data = event
    return responses.sse(data, kind)


class MessageEvents:
    """One message's events; `feed` each of its choice's deltas (after the choice took it
    in: `c` is the choice so far)."""

    def __init__(self, req: GenerationRequest, request_id: str):
        self.req, self.id = req, message_id(request_id)
        self.shaper = req.tools.shaper() if req.tools is not None else None
        self.index = -1  # the last block started
        self.open: str | None = None  # the open block's type
        self.started = False

    def feed(self, c: ChoiceState, delta: Delta) -> list[Event]:
        out = [] if self.started else self._start(c)
        if delta.reasoning and self.req.shows_reasoning:
            self._block({"type": "thinking", "thinking": "", "signature": ""}, out)
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        for e in self._content(delta):
            if isinstance(e, Content):
                self._block({"type": "text", "text": ""}, out)
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif isinstance(e, CallStart):
                self._block({"type": "tool_use", "id": tool_use_id(e.id), "name": e.name,
                             "input": {}}, out)
            elif isinstance(e, CallArgs) and e.fragment:
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": e.fragment}))
        if delta.finish_reason is not None:
            out += self._finish(c)
        return out

    def _start(self, c: ChoiceState) -> list[Event]:
        self.started = True
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
               "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(c)}
        return [("message_start", {"type": "message_start", "message": msg}),
                ("ping", {"type": "ping"})]

    def _content(self, delta: Delta) -> list:
        """The delta's text as tool-shaper events (all Content without tools)."""
        if self.shaper is None:
            return [Content(delta.text)] if delta.text else []
        events = self.shaper.feed(delta.text)
        if delta.finish_reason is not None:
            events += self.shaper.finish()
        return events

    def _block(self, block: dict, out: list[Event]) -> None:
        """Start `block` unless one of its type is open (a tool_use always starts anew)."""
        if self.open == block["type"] != "tool_use":
            return
        self._close(out)
        self.index += 1
        self.open = block["type"]
        out.append(("content_block_start", {"type": "content_block_start",
                                            "index": self.index, "content_block": block}))

    def _delta(self, delta: dict) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                        "delta": delta})

    def _close(self, out: list[Event]) -> None:
        if self.open is None:
            return
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None

    def _finish(self, c: ChoiceState) -> list[Event]:
        out: list[Event] = []
        self._close(out)
        called = self.shaper is not None and self.shaper.calls > 0
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": stop_fields(c, called), "usage": usage(c)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out


class _Writer:
    """Writes events to a started stream; with `keepalive` running, a ping goes out after
    PING_S without a write (writes never interleave: one lock)."""

    def __init__(self, resp: web.StreamResponse):
        self.resp, self.lock, self.last = resp, asyncio.Lock(), time.monotonic()

    async def send(self, events: list[Event]) -> None:
        data = b"".join(map(sse, events))
        async with self.lock:
            await self.resp.write(data)
            self.last = time.monotonic()

    async def keepalive(self) -> None:
        with contextlib.suppress(ConnectionResetError):
            while True:
                await asyncio.sleep(max(self.last + PING_S - time.monotonic(), 0.01))
                if time.monotonic() - self.last >= PING_S:
                    await self.send([("ping", {"type": "ping"})])


collect = collector(message)


async def stream(gw, request: web.Request, req: GenerationRequest,
                 inflight: Inflight) -> web.StreamResponse:
    """The SSE answer (see the module's docstring)."""
    events = MessageEvents(req, inflight.request_id)
    resp: web.StreamResponse | None = None
    writer: _Writer | None = None
    pinger: asyncio.Task | None = None
    try:
        async for c, delta, _ in deltas(gw, req, inflight):
            out = events.feed(c, delta)
            if writer is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
                await resp.prepare(request)
                writer = _Writer(resp)
                pinger = asyncio.create_task(writer.keepalive())
            await writer.send(out)
    except APIError as e:
        if writer is None:
            raise
        await writer.send([("error", error_body(e))])
    finally:
        if pinger is not None:
            pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinger
    await resp.write_eof()
    return resp


ANTHROPIC = Answer(collect, stream)  # /v1/messages
