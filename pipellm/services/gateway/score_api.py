"""vLLM's scoring and pooling APIs on a pooling server (--runner pooling): `/score` and
`/v1/score`, `/rerank`, `/v1/rerank` and `/v2/rerank` (Jina's and Cohere's), `/classify`,
`/pooling`. Bodies: score_request.py (and embeddings_request.py for /pooling).

/score and /rerank send their pairs to the tokenizers as one EmbedRequest (score_pairs.py):
on a model with a scoring head, cross-encoder pairs scored by the sigmoid of the head's logit
(a one-label classifier, as vLLM and CrossEncoder give it; a yes/no reranker's logit[yes] -
logit[no]); on an embedding model, each text embedded once and a pair scored by the cosine of
its embeddings (vLLM's bi-encoder). /classify gives each label's probability (softmax; sigmoid
for one label), /pooling the pooled vectors /v1/embeddings gives, a classifier's
probabilities (its task, as vLLM's /pooling gives them) or a reward model's every token's rows.

On a generation server every one is a 400, as /v1/embeddings is; /classify on an embedding
model (no scoring head) too, /score and /rerank on a classifier of several labels (use
/classify), and all but /pooling on a reward model.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from array import array
from dataclasses import replace

from aiohttp import web

from pipellm.services.gateway.embed_encoding import respond, rows_of
from pipellm.services.gateway.embeddings_api import message_id
from pipellm.services.gateway.embeddings_request import (
    EmbeddingSettings,
    EmbeddingsRequest,
    parse_embeddings,
    pooling_task,
)
from pipellm.services.gateway.errors import APIError, bad_request
from pipellm.services.gateway.json_body import read_json_body
from pipellm.services.gateway.score_pairs import pair_scores, pairs_message, sigmoid, truncate_pairs
from pipellm.services.gateway.score_request import (
    ClassifyRequest,
    PairsRequest,
    parse_classify,
    parse_rerank,
    parse_score,
)
from pipellm.shared.codec import int32s
from pipellm.shared.messages import EmbedRequest, EmbedResult

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


class ScoreAPI:
    def __init__(self, gw):
        self.gw = gw

    @property
    def settings(self):
        return self.gw.embeddings_api.settings

    def add_routes(self, router: web.UrlDispatcher) -> None:
        for path in SCORE_PATHS:
            router.add_post(path, self.score)
        for path in RERANK_PATHS:
            router.add_post(path, self.rerank)
        router.add_post("/classify", self.classify)
        router.add_post("/pooling", self.pooling)

    async def score(self, request: web.Request) -> web.Response:
        with self.gw.pending.hold():  # 429 past --max-pending
            self._check("Score API", one_label=True)
            req = parse_score(await read_json_body(request), **self._limits())
            rid = message_id("score", request, req.request_id)
            scores, tokens = await self._pairs(req, "text_2", rid)
            return web.json_response(score_answer(req.model, scores, tokens, rid))

    async def rerank(self, request: web.Request) -> web.Response:
        with self.gw.pending.hold():
            self._check("Rerank API", one_label=True)
            req = parse_rerank(await read_json_body(request), **self._limits())
            rid = message_id("rerank", request, req.request_id)
            scores, tokens = await self._pairs(req, "documents", rid)
            return web.json_response(rerank_answer(req, scores, tokens, rid))

    async def classify(self, request: web.Request) -> web.Response:
        with self.gw.pending.hold():
            self._check("Classification API", head=True)
            req = parse_classify(await read_json_body(request), **self._limits())
            rid = message_id("classify", request, req.request_id)
            result = await self._exchange(self._classify_message(req, rid), "input")
            return web.json_response(classify_answer(req, result, self.settings.scoring.labels))

    async def pooling(self, request: web.Request) -> web.Response:
        gw = self.gw
        with gw.pending.hold():
            self._check("Pooling API", reward=True)
            body = await read_json_body(request)
            task = pooling_task(body, self.settings)
            req = parse_embeddings(body, gw.model_name, self.settings,
                                   max_text_bytes=gw.svc.prompt_bytes_limit(gw.max_model_len),
                                   ignored=None if gw.svc.strict_request_fields else [])
            rid = message_id("pool", request, req.request_id)
            if task == "classify":
                result = activated(await self._exchange(req.message(
                    rid, gw.svc.addr("gateway"), "classify"), "input"), req.use_activation)
            else:
                result = await gw.embeddings_api.run(req, rid)
            per_token = task == "token_classify"
            return respond(req.encoding, rows_of(result, per_token),
                           pooling_answer(result, req, per_token))

    def _check(self, api: str, head: bool = False, one_label: bool = False,
               reward: bool = False) -> None:
        check_serves(self.settings, api, head, one_label, reward)

    def _limits(self) -> dict:
        gw = self.gw
        return {"model_name": gw.model_name, "max_model_len": self.settings.max_model_len,
                "max_text_bytes": gw.svc.prompt_bytes_limit(gw.max_model_len),
                "ignored": None if gw.svc.strict_request_fields else []}

    def _classify_message(self, req: ClassifyRequest, rid: str) -> EmbedRequest:
        return EmbedRequest(rid, self.gw.svc.addr("gateway"),
                            inputs=[int32s(ids) for ids in req.ids or ()],
                            texts=None if req.texts is None else list(req.texts),
                            truncate_prompt_tokens=req.truncate_prompt_tokens,
                            truncation_side=req.truncation_side,
                            add_special_tokens=req.add_special_tokens, task="classify")

    async def _pairs(self, req: PairsRequest, param: str, rid: str
                     ) -> tuple[list[float], int]:
        """Each pair's score (in order) and the tokens of the inputs scored (request `rid`)."""
        scoring = self.settings.scoring
        if req.max_tokens != (0, 0):  # tokenizes every text: off the event loop
            req = await asyncio.to_thread(truncate_pairs, req, self.gw.tokenizer)
        result = await self._exchange(pairs_message(
            req, scoring, rid, self.gw.svc.addr("gateway")), param)
        return pair_scores(req, scoring, result), sum(result.num_tokens)

    async def _exchange(self, msg: EmbedRequest, param: str) -> EmbedResult:
        """The EmbedResult of `msg`; an input's error names this API's field `param`."""
        try:
            return await self.gw.embeddings_api.exchange(msg)
        except APIError as e:
            if e.param == "input":
                e.param = param
            raise


def check_serves(settings: EmbeddingSettings, api: str, head: bool = False,
                 one_label: bool = False, reward: bool = False) -> None:
    """A 400 (on `model`) where a server of `settings` does not serve `api` (`head`: it needs
    a scoring head; `one_label`: a classifier's one; `reward`: a reward model serves it)."""
    if not settings.pooling:
        raise bad_request(f"The model does not support {api}: this server generates "
                          "(start one with --runner pooling)", "model")
    if settings.reward and not reward:
        raise bad_request(f"The model does not support {api}: it is a reward model "
                          "(--convert reward): use /pooling", "model")
    scoring = settings.scoring
    if head and not scoring.scores:
        raise bad_request(f"The model does not support {api}: it is an embedding model "
                          "without a scoring head (serve a sequence classification model "
                          "or a yes/no reranker)", "model")
    if one_label and scoring.scores and scoring.num_labels != 1:
        raise bad_request(f"The model does not support {api}: its classifier has "
                          f"{scoring.num_labels} labels, scoring needs one (use /classify)",
                          "model")


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _head(rid: str, model: str) -> dict:
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model}


def score_answer(model: str, scores: list[float], tokens: int, rid: str = "") -> dict:
    """vLLM's /score answer: one score per pair, in pair order (`rid`: its id)."""
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {**_head(rid or f"score-{secrets.token_hex(12)}", model), "data": data,
            "usage": _usage(tokens)}


def rerank_answer(req: PairsRequest, scores: list[float], tokens: int, rid: str = "") -> dict:
    """vLLM's (Jina's) rerank answer: the documents by score, best first, the top_n of them."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": req.pairs[i][1]}
        results.append(item)
    return {"id": rid or f"rerank-{secrets.token_hex(12)}", "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


def activation(row: list[float], use: bool | None = True) -> list[float]:
    """A scoring head's row as its probabilities (softmax; sigmoid for one label), or as it is
    where `use` is False."""
    if use is False:
        return row
    return [sigmoid(row[0])] if len(row) == 1 else softmax(row)


def activated(result: EmbedResult, use: bool | None) -> EmbedResult:
    """`result` with each row through `activation`."""
    k = result.dim
    rows = [activation(list(result.vectors[i * k:(i + 1) * k]), use)
            for i in range(len(result.num_tokens))]
    return replace(result, vectors=array("f", [v for row in rows for v in row]))


def classify_answer(req: ClassifyRequest, result: EmbedResult, labels: tuple[str, ...]) -> dict:
    """vLLM's /classify answer: each input's label probabilities and its most likely label."""
    k, data = result.dim, []
    for i in range(len(result.num_tokens)):
        probs = activation(list(result.vectors[i * k:(i + 1) * k]), req.use_activation)
        best = max(range(k), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels) else str(best),
                     "probs": probs, "num_classes": k})
    return {**_head(result.request_id, req.model), "data": data,
            "usage": _usage(sum(result.num_tokens))}


def pooling_answer(result: EmbedResult, req: EmbeddingsRequest, per_token: bool = False
                   ) -> dict:
    """vLLM's /pooling answer: each input's pooled vector (as /v1/embeddings pools it); a
    reward model's (`per_token`) its [tokens, k] rows (base64: their bytes, row after row)."""
    data = [{"index": i, "object": "pooling", "data": req.encoding.json_value(values)}
            for i, values in enumerate(rows_of(result, per_token))]
    return {**_head(result.request_id, req.model), "data": data,
            "usage": _usage(sum(result.num_tokens))}
