"""The OpenAI-compatible HTTP front: aiohttp handlers over the gateway's channels.

A generation request is validated (protocol.py), recorded as queued in Redis, sent to the
tokenizers, and answered from the Deltas that come back: collected into one JSON response, or
streamed as SSE. A client that leaves gets its request aborted in compute (KV freed).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time

import redis.asyncio as aioredis
from aiohttp import web

from pipellm.services.gateway import protocol, responses
from pipellm.services.gateway.access import Cors, api_key_middleware
from pipellm.services.gateway.chat_settings import ChatSettings
from pipellm.services.gateway.embeddings_api import EmbeddingsAPI, refuse_generation
from pipellm.services.gateway.embeddings_request import EmbeddingSettings
from pipellm.services.gateway.errors import bad_request, errors_as_json, not_found, unavailable
from pipellm.services.gateway.health import Health
from pipellm.services.gateway.inflight import Inflight, Registry
from pipellm.services.gateway.invocations import invocation_path
from pipellm.services.gateway.json_body import check_prompt_bytes, read_json_body
from pipellm.services.gateway.lora_api import LoraAPI
from pipellm.services.gateway.messages_api import MessagesAPI, error_body
from pipellm.services.gateway.metrics import Metrics
from pipellm.services.gateway.pending import PendingLimit
from pipellm.services.gateway.responses_api import ResponsesAPI
from pipellm.services.gateway.score_api import ScoreAPI
from pipellm.services.gateway.stream import OPENAI, Answer
from pipellm.services.gateway.utility import Utility
from pipellm.services.gateway.validation import check_request_id
from pipellm.shared import state
from pipellm.shared.chat_template import ChatTemplate
from pipellm.shared.config import ServiceConfig
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.lora import LoraModule
from pipellm.shared.messages import Abort, TokenizeRequest
from pipellm.shared.transport import AsyncFanout, AsyncSender

log = logging.getLogger("pipellm.gateway")
_REQUEST_ID = web.RequestKey("request_id", str)
PEER_WAIT_MS = 3000  # how long a request waits for a tokenizer worker to (re)connect
# path prefix -> the error body of APIs not shaped as OpenAI's
ERROR_SHAPES: dict = {"/v1/messages": error_body}


class Gateway:
    """Everything the handlers share. Built by `service.serve`, or by tests with fakes of
    nothing: real sockets and a real Redis."""

    def __init__(self, svc: ServiceConfig, model_name: str, max_model_len: int, tokenizer,
                 redis_client: aioredis.Redis, to_tokenizer: AsyncSender,
                 to_control: AsyncSender | AsyncFanout, template: ChatTemplate | None = None,
                 defaults: GenerationDefaults | None = None, adapters: tuple[LoraModule, ...] = (),
                 lora_api: tuple[int | None, int] | None = None,
                 embeddings: EmbeddingSettings | None = None, priorities: bool = False):
        """`template`: the chat template /tokenize renders messages with (the tokenizers
        render generation requests' own). `defaults`: the model's sampling defaults, for
        requests that leave fields unset (--generation-config). `adapters`: the LoRA adapters
        a request may name as its model (--lora-modules); `lora_api`: (--max-cpu-loras,
        --max-lora-rank) where adapters are loaded and unloaded at run time (lora_api.py).
        `embeddings`: the served embedder on a pooling server (--runner pooling), else None:
        /v1/embeddings is then a 400 (embeddings_api.py). `priorities`: whether compute
        schedules by a request's priority (--scheduling-policy priority or predicted; under
        fcfs a non-zero priority is a 400, as vLLM's)."""
        self.svc, self.model_name, self.max_model_len = svc, model_name, max_model_len
        self.priorities = priorities
        self.set_adapters(adapters)
        if model_name in self.adapter_names:
            raise ValueError(f"--lora-modules: adapter name {model_name!r} is the served "
                             "model's name")
        self.lora_api = None if lora_api is None else LoraAPI(self, *lora_api)
        self.defaults = defaults or GenerationDefaults()
        self.tokenizer, self.template = tokenizer, template
        self.seeds = random.Random(svc.seed) if svc.seed is not None else None
        self.redis = redis_client
        self.to_tokenizer, self.to_control = to_tokenizer, to_control
        self.registry = Registry()
        self.pending = PendingLimit(svc.max_pending)  # counted before the body is read
        self.metrics = Metrics(model_name)
        self.health = Health(redis_client, svc.server, self.registry, self.resume_lost,
                             self._abort_ids, self.metrics, svc.data_parallel_size)
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        self.chat_settings = ChatSettings.of(svc, template)
        self.responses_api = ResponsesAPI(self)
        self.embeddings_api = EmbeddingsAPI(self, embeddings)

    def token_text(self, token_id: int) -> str:
        """One token as a string, as logprobs answers list it (cached)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 1 << 18:
                self._token_texts[token_id] = text
        return text

    def app(self) -> web.Application:
        """The aiohttp app. Middlewares, outermost first: CORS preflights, errors as JSON (so a
        401 is one too), the API key; CORS headers go on every answer as it is prepared."""
        middlewares = [errors_as_json(ERROR_SHAPES)]
        if self.svc.api_key:
            middlewares.append(api_key_middleware(self.svc.api_key))
        if self.embeddings_api.settings.pooling:
            middlewares.append(refuse_generation())
        cors = Cors(self.svc.origins())
        if cors.origins:
            middlewares.insert(0, cors.preflight)
        app = web.Application(client_max_size=self.svc.max_body_bytes, middlewares=middlewares)
        if cors.origins:
            app.on_response_prepare.append(cors.on_prepare)
        app.on_response_prepare.append(_echo_request_id)
        Utility(self).add_routes(app.router)
        MessagesAPI(self).add_routes(app.router)
        self.responses_api.add_routes(app.router)
        self.embeddings_api.add_routes(app.router)
        ScoreAPI(self).add_routes(app.router)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        if self.lora_api is not None:
            self.lora_api.add_routes(app.router)
        app.router.add_get("/health", self.health_check)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/requests/{request_id}", self.request_state)
        app.router.add_get("/load", self.load)
        self.routes = {r.resource.canonical: r.handler for r in app.router.routes()
                       if r.method == "POST" and r.resource is not None}
        app.router.add_post("/invocations", self.invocations)
        return app

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's /invocations (invocations.py): the body's API answers it."""
        path = invocation_path(await read_json_body(request), self.embeddings_api.settings)
        return await self.routes[path](request)  # the body is read once: it is cached

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's /load: the requests in flight."""
        return web.json_response({"server_load": len(self.registry.requests)})

    def set_adapters(self, adapters: tuple[LoraModule, ...]) -> None:
        """The LoRA adapters requests may name from now on."""
        self.adapters = adapters
        self.adapter_names = frozenset(a.name for a in adapters)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self.pending.hold():  # 429 past --max-pending, before anything is awaited
            body = await read_json_body(request)
            return await self._generate(request, protocol.parse_completion(
                body, self.model_name, defaults=self.defaults,
                strict=self.svc.strict_request_fields, adapters=self.adapter_names))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        with self.pending.hold():
            body = await read_json_body(request)
            return await self._generate(request, protocol.parse_chat(
                body, self.model_name, defaults=self.defaults, chat=self.chat_settings,
                strict=self.svc.strict_request_fields, adapters=self.adapter_names))

    async def _generate(self, request: web.Request, req: protocol.GenerationRequest,
                        answer: Answer = OPENAI) -> web.StreamResponse:
        """Record, send and answer a validated request, in `answer`'s API shape."""
        given = check_request_id(request.headers.get("X-Request-Id"), "X-Request-Id")
        rid = responses.new_id(req.kind, given or req.request_id)  # the header wins, as vLLM's
        request[_REQUEST_ID] = given or rid  # echoed in the X-Request-Id header
        inflight = await self.submit(req, rid)
        try:
            if req.stream:
                return await answer.stream(self, request, req, inflight)
            return await answer.collect(self, req, inflight)
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.requests.labels("aborted").inc()
            await self._abort_ids([rid], "aborted")
            raise
        finally:
            self.registry.remove(rid)

    async def submit(self, req: protocol.GenerationRequest, rid: str,
                     seed: int | None = None, send: bool = True) -> Inflight:
        """Record the request as queued in Redis, register it under `rid` and send it to the
        tokenizers (unseeded: with `seed`, else one drawn here; `send` False: its caller sends
        `inflight.tokenize`). Its caller reads its deltas and removes it from the registry
        when done; on an error here it is removed."""
        check_prompt_bytes(req.prompts, req.messages,
                           self.svc.prompt_bytes_limit(self.max_model_len))
        if req.options.get("priority", 0) and not self.priorities:
            raise bad_request(f"Got priority {req.options['priority']} but Priority scheduling "
                              "is not enabled.", "priority")
        if not self.health.ok:
            raise unavailable(f"Not ready: {self.health.reason}")
        if rid in self.registry.requests:
            raise bad_request(f"request id {rid!r} is already in use"[:300], "request_id")
        if req.ignored:
            log.warning("%s: fields present in the request but ignored: %s", rid,
                        ", ".join(req.ignored))
        try:
            pipe = self.redis.pipeline(transaction=False)
            state.set_request(pipe, rid, status="queued", queued_at=time.time(),
                              n=req.generated * req.num_prompts, model=req.model, kind=req.kind)
            await pipe.execute()
        except aioredis.RedisError:
            raise unavailable("Request state store (Redis) is unavailable.") from None
        inflight = self.registry.add(rid, req.generated * req.num_prompts)
        try:
            inflight.tokenize = self._tokenize_requests(rid, req, inflight, seed)
            for tokenize in inflight.tokenize if send else ():
                if not await self.send_tokenize(tokenize):
                    raise unavailable("No tokenizer worker is connected; retry shortly.")
        except BaseException:
            self.registry.remove(rid)
            raise
        return inflight

    async def send_tokenize(self, tokenize: TokenizeRequest) -> bool:
        """Send to a tokenizer worker, waiting up to PEER_WAIT_MS for one to (re)connect;
        False if none did."""
        return await self.to_tokenizer.send(tokenize, wait_ms=PEER_WAIT_MS)

    def _tokenize_requests(self, rid: str, req: protocol.GenerationRequest,
                           inflight: Inflight, seed: int | None = None
                           ) -> list[TokenizeRequest]:
        # an unseeded request's seed is drawn here, so a resumed choice samples what it would
        if seed is None:
            seed = self.seeds.getrandbits(62) if self.seeds else secrets.randbits(62)
        return req.tokenize_requests(rid, self.svc.addr("gateway"), seed, inflight.arrival)

    async def resume_lost(self, only_without_output: bool, ranks: set[int] | None = None) -> None:
        """A restarted service lost requests: each continues from what its client has (the
        lost attempts are aborted in compute, where they may still run). `ranks`: the
        restarted computes, whose requests alone are lost (None: all)."""
        keep = await self._routed_to(ranks) if ranks is not None else None
        connected = True
        for inflight, tokenize, lost in self.registry.resume(only_without_output, keep):
            for rid in lost:
                await self.to_control.send(Abort(rid))
            for one in tokenize:
                connected = connected and await self.send_tokenize(one)
            if tokenize and not connected:
                inflight.fail("No tokenizer worker is connected to resume the request; retry.")
        await self.embeddings_api.resend()

    async def _routed_to(self, ranks: set[int]) -> set[str] | None:
        """Ids of the requests in flight that the tokenizers routed to one of `ranks`, or not
        yet anywhere, as their state records (None: all, with one compute or without Redis)."""
        if self.svc.data_parallel_size == 1:
            return None
        ids = list(self.registry.requests)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for rid in ids:
                pipe.hget(state.req_key(rid), "rank")
            where = await pipe.execute()
        except aioredis.RedisError:
            return None
        return {rid for rid, rank in zip(ids, where, strict=True)
                if rank is None or int(rank) in ranks}

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


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A generation's answer carries its id in the X-Request-Id header (the client's, if sent)."""
    if _REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[_REQUEST_ID]
