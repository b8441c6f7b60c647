"""The pooling runner's API (--runner pooling): OpenAI's `POST /v1/embeddings`, and the
generation APIs a pooling server refuses.

A request (embeddings_request.py) goes to the tokenizers as an EmbedRequest; the tokenizer
that takes it tokenizes its texts and sends it to a compute, which answers this gateway (the
request's `reply_to`) with an EmbedResult: the vectors (float32) and each input's token count,
or an error. The request waits on its Inflight's queue in the gateway's registry, so an outage
fails it as any other request (health.py); a restart of a service resends every embeddings
request in flight (`resend`: they are idempotent, a late duplicate answer is dropped).

On a generation server /v1/embeddings is a 400; on a pooling server the chat, completions,
Messages and Responses APIs are (`refuse_generation`), as vLLM answers them.
"""

from __future__ import annotations

import logging
import secrets
import time

from aiohttp import web

from pipellm.services.gateway.cohere_embed import cohere_answer, parse_cohere_embed
from pipellm.services.gateway.embed_encoding import respond, rows_of
from pipellm.services.gateway.embeddings_request import (
    EmbeddingSettings,
    EmbeddingsRequest,
    parse_embeddings,
)
from pipellm.services.gateway.errors import APIError, bad_request, unavailable
from pipellm.services.gateway.inflight import MAX_RESUMES
from pipellm.services.gateway.json_body import read_json_body
from pipellm.services.gateway.validation import check_request_id
from pipellm.shared.messages import Delta, EmbedRequest, EmbedResult

log = logging.getLogger("pipellm.gateway")
# path prefix -> the API's name in a pooling server's refusal
GENERATION_APIS = {"/v1/chat/completions": "Chat Completions API",
                   "/v1/completions": "Completions API", "/v1/messages": "Messages API",
                   "/v1/responses": "Responses API"}


class EmbeddingsAPI:
    def __init__(self, gw, settings: EmbeddingSettings | None = None):
        self.gw, self.settings = gw, settings or EmbeddingSettings()
        self.sent: dict[str, EmbedRequest] = {}  # in flight, by request id: what to resend

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/embeddings", self.embeddings)
        router.add_post("/v2/embed", self.cohere_embed)

    async def embeddings(self, request: web.Request) -> web.Response:
        with self.gw.pending.hold():  # 429 past --max-pending
            req = await self._parse(request, "Embeddings API", parse_embeddings)
            result = await self.run(req, message_id("embd", request, req.request_id))
            return respond(req.encoding, rows_of(result), answer(result, req))

    async def cohere_embed(self, request: web.Request) -> web.Response:
        """Cohere's /v2/embed (cohere_embed.py)."""
        with self.gw.pending.hold():
            embed = await self._parse(request, "Embed API", parse_cohere_embed)
            result = await self.run(embed.request, message_id("embd", request, None))
            return web.json_response(cohere_answer(result, embed))

    async def _parse(self, request: web.Request, api: str, parse):
        """The body of `request` parsed by `parse`, on a server that embeds (else a 400);
        unknown keys logged (or, with --strict-request-fields, a 400)."""
        gw = self.gw
        if not self.settings.pooling:
            raise bad_request(f"The model does not support {api}: this server generates "
                              "(start one with --runner pooling)", "model")
        if self.settings.reward:
            raise bad_request(f"The model does not support {api}: it is a reward model "
                              "(--convert reward): use /pooling", "model")
        ignored = None if gw.svc.strict_request_fields else []
        parsed = parse(await read_json_body(request), gw.model_name, self.settings,
                       max_text_bytes=gw.svc.prompt_bytes_limit(gw.max_model_len),
                       ignored=ignored)
        if ignored:
            log.warning("%s: fields present in the request but ignored: %s", request.path,
                        ", ".join(ignored))
        return parsed

    async def run(self, req: EmbeddingsRequest, rid: str) -> EmbedResult:
        """Send `req` on as request `rid` and wait for its EmbedResult (a reward model's: per
        token); an error as an APIError."""
        return await self.exchange(req.message(
            rid, self.gw.svc.addr("gateway"), "reward" if self.settings.reward else "embed"))

    async def exchange(self, msg: EmbedRequest) -> EmbedResult:
        """Send `msg` (an embeddings, pooling or scoring request) to a tokenizer and wait for
        its EmbedResult; an error as an APIError."""
        gw, rid = self.gw, msg.request_id
        if not gw.health.ok:
            raise unavailable(f"Not ready: {gw.health.reason}")
        if rid in gw.registry.requests:  # a client's id given twice at once
            raise bad_request(f"request id {rid!r} is already in use"[:300], "request_id")
        inflight = gw.registry.add(rid, 1)
        self.sent[rid] = msg
        outcome = "aborted"  # the client left, unless it gets an answer
        try:
            if not await gw.send_tokenize(msg):
                outcome = "failed"
                raise unavailable("No tokenizer worker is connected; retry shortly.")
            result = await inflight.deltas.get()
            outcome = "failed" if isinstance(result, Delta) or result.error else "finished"
        finally:
            gw.registry.remove(rid)
            self.sent.pop(rid, None)
            gw.metrics.requests.labels(outcome).inc()
        if isinstance(result, Delta):  # failed by the health monitor: a service is down
            raise APIError(result.error_status or 503, result.error or "failed")
        if result.error is not None:
            raise APIError(result.error_status or 500, result.error, param=result.error_param)
        gw.metrics.e2e.observe(time.monotonic() - inflight.start)
        return result

    def deliver(self, result: EmbedResult) -> None:
        """An EmbedResult from a tokenizer or compute, to its request (if still waiting)."""
        inflight = self.gw.registry.requests.get(result.request_id)
        if inflight is not None:
            inflight.deltas.put_nowait(result)

    async def resend(self) -> None:
        """Every embeddings request in flight again (a service restarted: it may be lost); one
        lost more than MAX_RESUMES times (it may be what crashes a service) fails instead."""
        for msg in list(self.sent.values()):
            inflight = self.gw.registry.requests.get(msg.request_id)
            if inflight is None:
                continue
            if inflight.resumes >= MAX_RESUMES:
                inflight.fail(f"the request was lost {inflight.resumes + 1} times by "
                              "restarting services")
                continue
            inflight.resumes += 1
            if not await self.gw.send_tokenize(msg):
                inflight.fail("No tokenizer worker is connected to resume the request.")


def message_id(prefix: str, request: web.Request, given: str | None) -> str:
    """A pooling request's id: the API's prefix, then the client's id (its X-Request-Id
    header, else the body's `request_id`: vLLM's order), else a random one."""
    client = check_request_id(request.headers.get("X-Request-Id"), "X-Request-Id") or given
    return f"{prefix}-{client or secrets.token_hex(12)}"


def answer(result: EmbedResult, req: EmbeddingsRequest) -> dict:
    """OpenAI's embeddings response: one embedding per input, in input order."""
    data = [{"object": "embedding", "index": i, "embedding": req.encoding.json_value(row)}
            for i, row in enumerate(rows_of(result))]
    tokens = sum(result.num_tokens)
    return {"id": result.request_id, "object": "list", "created": int(time.time()),
            "data": data, "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def refuse_generation():
    """A pooling server's middleware: the generation APIs are a 400 (in their own error
    shape: the errors middleware outside it shapes it)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        for prefix, api in GENERATION_APIS.items():
            if request.path == prefix or request.path.startswith(prefix + "/"):
                raise bad_request(f"The model does not support {api}: this server runs "
                                  "--runner pooling (it serves /v1/embeddings)", "model")
        return await handler(request)

    return middleware
