"""The OpenAI-compatible HTTP front: aiohttp handlers over the gateway's channels.

A generation request is validated (protocol.py), recorded as queued in Redis, sent to the
tokenizers, and answered from the Deltas that come back: collected into one JSON response, or
streamed as SSE. A client that leaves gets its request aborted in compute (KV freed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import redis.asyncio as aioredis
from aiohttp import web

from services.gateway import protocol, responses
from services.gateway.errors import APIError, not_found, unavailable
from services.gateway.health import Health
from services.gateway.inflight import Inflight, Registry
from services.gateway.metrics import Metrics
from services.gateway.pending import PendingLimit
from services.gateway.stream import collect, stream
from services.gateway.validation import check_prompt_bytes, parse_json_body
from shared import state
from shared.codec import int32s
from shared.config import ServiceConfig
from shared.messages import Abort, ChatMessage, TokenizeRequest
from shared.transport import AsyncSender

log = logging.getLogger("pipellm.gateway")
_PEER_WAIT_MS = 3000  # how long a request waits for a tokenizer worker to (re)connect
_INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop (< 1 ms)


class Gateway:
    """Everything the handlers share. Built by `service.serve`, or by tests with fakes of
    nothing: real sockets and a real Redis."""

    def __init__(self, svc: ServiceConfig, model_name: str, max_model_len: int, tokenizer,
                 redis_client: aioredis.Redis, to_tokenizer: AsyncSender,
                 to_control: AsyncSender):
        self.svc, self.model_name, self.max_model_len = svc, model_name, max_model_len
        self.tokenizer = tokenizer
        self.redis = redis_client
        self.to_tokenizer, self.to_control = to_tokenizer, to_control
        self.registry = Registry()
        self.pending = PendingLimit(svc.max_pending)  # counted before the body is read
        self.metrics = Metrics()
        self.health = Health(redis_client, self.registry, self.resume_lost, self._abort_ids,
                             self.metrics)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """One token as a string, as logprobs answers list it (cached)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 1 << 18:
                self._token_texts[token_id] = text
        return text

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.svc.max_body_bytes,
                              middlewares=[_errors_as_json])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health_check)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/requests/{request_id}", self.request_state)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self.pending.hold():  # 429 past --max-pending, before anything is awaited
            body = await _json_body(request)
            return await self._generate(request, protocol.parse_completion(body, self.model_name))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        with self.pending.hold():
            body = await _json_body(request)
            return await self._generate(request, protocol.parse_chat(body, self.model_name))

    async def _generate(self, request: web.Request, req: protocol.GenerationRequest):
        check_prompt_bytes(req.prompt_text, req.messages,
                           self.svc.prompt_bytes_limit(self.max_model_len))
        if not self.health.ok:
            raise unavailable(f"Not ready: {self.health.reason}")
        rid = responses.new_id(req.kind)
        try:
            pipe = self.redis.pipeline(transaction=False)
            state.set_request(pipe, rid, status="queued", queued_at=time.time(), n=req.n,
                              model=req.model, kind=req.kind)
            await pipe.execute()
        except aioredis.RedisError:
            raise unavailable("Request state store (Redis) is unavailable.") from None
        inflight = self.registry.add(rid, req.n)
        try:
            inflight.tokenize = self._tokenize_request(rid, req, inflight)
            if not await self.to_tokenizer.send(inflight.tokenize, wait_ms=_PEER_WAIT_MS):
                raise unavailable("No tokenizer worker is connected; retry shortly.")
            if req.stream:
                return await stream(self, request, req, inflight)
            return await collect(self, req, inflight)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.requests.labels("aborted").inc()
            await self._abort_ids([rid], "aborted")
            raise
        finally:
            self.registry.remove(rid)

    def _tokenize_request(self, rid: str, req: protocol.GenerationRequest,
                          inflight: Inflight) -> TokenizeRequest:
        messages = None
        if req.messages is not None:
            messages = [ChatMessage(m["role"], m["content"]) for m in req.messages]
        params = req.params
        if params.seed is None:  # drawn here, so a resumed choice samples what it would have
            params = dataclasses.replace(params, seed=secrets.randbits(62))
        return TokenizeRequest(
            request_id=rid, reply_to=self.svc.addr("gateway"), params=params,
            prompt_text=req.prompt_text,
            prompt_ids=None if req.prompt_ids is None else int32s(req.prompt_ids),
            messages=messages, add_generation_prompt=req.add_generation_prompt,
            stop=list(req.stop), n=req.n,
            # chat without max_tokens: up to the context; completions keep 16 (OpenAI's default)
            max_tokens_auto=req.kind == "chat" and not req.max_tokens_given,
            arrival=inflight.arrival)

    async def resume_lost(self, only_without_output: bool) -> None:
        """A restarted service lost requests: each continues from what its client has (the
        lost attempts are aborted in compute, where they may still run)."""
        connected = True
        for inflight, tokenize, lost in self.registry.resume(only_without_output):
            for rid in lost:
                await self.to_control.send(Abort(rid))
            if tokenize is None:
                continue
            connected = connected and await self.to_tokenizer.send(tokenize,
                                                                   wait_ms=_PEER_WAIT_MS)
            if not connected:
                inflight.fail("No tokenizer worker is connected to resume the request; retry.")

    async def _abort_ids(self, ids: list[str], status: str) -> None:
        """Stop requests in compute (their KV is freed) and record how they ended in Redis.
        (The outcome metric is counted where each request's handler ends, once.)"""
        for rid in ids:
            await self.to_control.send(Abort(rid))  # dropped if compute is down: moot then
        try:
            pipe = self.redis.pipeline(transaction=False)
            for rid in ids:
                state.set_request(pipe, rid, self.svc.request_ttl_s, status=status,
                                  finished_at=time.time())
            await pipe.execute()
        except aioredis.RedisError:
            pass

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "pipellm", "max_model_len": self.max_model_len}]})

    async def health_check(self, request: web.Request) -> web.Response:
        if self.health.ok:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": self.health.reason},
                                 status=503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            content_type="text/plain", charset="utf-8")

    async def request_state(self, request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        try:
            raw = await self.redis.hgetall(state.req_key(rid))
        except aioredis.RedisError:
            raise unavailable("Request state store (Redis) is unavailable.") from None
        if not raw:
            raise not_found(f"No request with id `{rid}`.", "request_id")
        return web.json_response({"id": rid, **state.decode_hash(raw)})


async def _json_body(request: web.Request):
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, "Request body is too large.", code="payload_too_large") from None
    except web.RequestPayloadError:  # e.g. a Content-Encoding: gzip body that is not gzip
        raise APIError(400, "Request body could not be decoded (its Content-Encoding or "
                            "Transfer-Encoding is broken).") from None
    if len(raw) <= _INLINE_PARSE_BYTES:  # 400 unless UTF-8 JSON, bounded depth, ints, floats
        return parse_json_body(raw)
    # the checks of a large body are Python code: on a thread, the event loop serves meanwhile
    return await asyncio.get_running_loop().run_in_executor(None, parse_json_body, raw)


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    """Every failure leaves as an OpenAI-style JSON error, never a stack trace."""
    try:
        return await handler(request)
    except APIError as e:
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return web.json_response(e.body(), status=e.status, headers=headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = APIError(e.status, e.reason or "error", code=None)
        return web.json_response(err.body(), status=e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # a bug: log it, answer 500, keep serving
        log.exception("unhandled error on %s", request.path)
        err = APIError(500, "Internal server error.")
        return web.json_response(err.body(), status=500)
