"""OpenAI's Responses API over the chat path: `POST /v1/responses`, `GET /v1/responses/{id}`
(with `?stream=true&starting_after=N`: a background response's events), `POST
/v1/responses/{id}/cancel`, `DELETE /v1/responses/{id}` and `GET
/v1/responses/{id}/input_items` (what the Agents SDK and Codex speak).

A body is translated into a chat body (request.py), generated as any chat request, and answered
as a Response object or its stream events (output.py, run.py). `store` (default true) keeps it
in Redis (store.py) for previous_response_id and GET; `background: true` answers at once and
generates in a task (jobs.py) whose output is written to Redis as it comes, so it can be polled,
streamed again from any event, cancelled, and continued by a restarted gateway.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

from aiohttp import web

from pipellm.services.gateway import responses
from pipellm.services.gateway.errors import bad_request, not_found
from pipellm.services.gateway.json_body import read_json_body
from pipellm.services.gateway.responses_api.jobs import Jobs, follow
from pipellm.services.gateway.responses_api.request import Parsed, parse_request
from pipellm.services.gateway.responses_api.run import Run, new_object
from pipellm.services.gateway.responses_api.store import TERMINAL, ResponseStore
from pipellm.services.gateway.stream import Answer
from pipellm.services.gateway.validation import check_request_id

log = logging.getLogger("pipellm.gateway")


class ResponsesAPI:
    """The handlers, over a Gateway (its settings, Redis, registry and `submit`)."""

    def __init__(self, gateway):
        self.gw = gateway
        svc = gateway.svc
        self.store = ResponseStore(gateway.redis, svc.responses_store_ttl,
                                   svc.responses_store_max_bytes, svc.server)
        self.jobs = Jobs(gateway, self.store, self.parse)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{id}", self.retrieve)
        router.add_delete("/v1/responses/{id}", self.delete)
        router.add_post("/v1/responses/{id}/cancel", self.cancel)
        router.add_get("/v1/responses/{id}/input_items", self.input_items)

    def parse(self, body: dict, history: list[dict] | None) -> Parsed:
        gw = self.gw
        parsed = parse_request(body, gw.model_name, history, defaults=gw.defaults,
                               chat=gw.chat_settings, strict=gw.svc.strict_request_fields,
                               adapters=gw.adapter_names)
        for note in parsed.notes:
            log.info("/v1/responses: %s", note)
        return parsed

    async def _history(self, body) -> list[dict] | None:
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        if prev is None:
            return None
        if not isinstance(prev, str):
            raise bad_request("previous_response_id must be a string", "previous_response_id")
        record = await self.store.load(prev)
        if record is None or record["input"] is None:
            raise not_found(f"Previous response with id '{prev[:100]}' not found.",
                            "previous_response_id")
        if record["state"] not in TERMINAL:
            raise bad_request(f"Previous response '{prev[:100]}' is still in progress.",
                              "previous_response_id")
        return record["input"] + record["response"]["output"]

    async def create(self, request: web.Request) -> web.StreamResponse:
        with self.gw.pending.hold():
            body = await read_json_body(request)
            history = await self._history(body)
            parsed = self.parse(body, history)
            given = check_request_id(request.headers.get("X-Request-Id"), "X-Request-Id")
            key = given or parsed.req.request_id or uuid.uuid4().hex
            req = dataclasses.replace(parsed.req, request_id=key)
            parsed = dataclasses.replace(parsed, req=req)
            obj = new_object(f"resp_{key}", req.model, parsed.echo,
                             "queued" if parsed.background else "in_progress")
            run = Run(self.gw, parsed, obj, self.store,
                      {"body": body, "history": history, "rid": responses.new_id("chat", key)})
            if parsed.background:
                await self.jobs.start(run)
                if req.stream:
                    return await follow(request, self.store, self.parse, obj["id"], -1)
                return web.json_response(obj)
            return await self.gw._generate(request, req, Answer(run.collect, run.stream))

    async def _record(self, request: web.Request) -> dict:
        rid = request.match_info["id"]
        record = await self.store.load(rid)
        if record is None or record["response"] is None:
            raise not_found(f"Response with id '{rid[:100]}' not found.", "response_id")
        return record

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        record = await self._record(request)
        obj = record["response"]
        if request.query.get("stream", "false").lower() == "true":
            if not obj.get("background"):
                raise bad_request("only background responses can be streamed again", "stream")
            after = request.query.get("starting_after", "-1")
            if not after.lstrip("-").isdigit():
                raise bad_request("starting_after must be an integer", "starting_after")
            return await follow(request, self.store, self.parse, obj["id"], int(after))
        if record["state"] not in TERMINAL:
            obj = await self.jobs.snapshot(record)
        return web.json_response(obj)

    async def cancel(self, request: web.Request) -> web.Response:
        record = await self._record(request)
        if not record["response"].get("background"):
            raise bad_request("only background responses can be cancelled", "response_id")
        return web.json_response(await self.jobs.cancel(record))

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        await self.jobs.cancel_local(rid)
        if not await self.store.delete(rid):
            raise not_found(f"Response with id '{rid[:100]}' not found.", "response_id")
        return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: web.Request) -> web.Response:
        record = await self._record(request)
        items = [dict(item, id=item.get("id") or f"item_{i}")
                 for i, item in enumerate(record["input"] or [])]
        return web.json_response({"object": "list", "data": items[::-1], "has_more": False,
                                  "first_id": items[-1]["id"] if items else None,
                                  "last_id": items[0]["id"] if items else None})
