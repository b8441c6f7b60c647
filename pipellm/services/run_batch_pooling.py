"""run-batch's lines for the pooling APIs (a pooling model: --runner pooling, --convert ...).

The urls vLLM's run_batch takes for them: `/v1/embeddings`, any ending in `/score` (`/score`,
`/v1/score`) and any ending in `/rerank` (`/rerank`, `/v1/rerank`, `/v2/rerank`). Each line is
parsed and checked as the gateway does (embeddings_request.py, score_request.py and
score_api.check_serves: a line the model cannot serve is its 400), becomes the one EmbedRequest
the gateway would send (score_pairs.py for pairs), is tokenized by the tokenizer's own
`prepare_embed`, then every line runs through compute's own EmbedCore together (batched per
task and width), and its EmbedResult becomes the body the gateway answers with.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pipellm.services.compute.embed_core import EmbedCore
from pipellm.services.gateway.embeddings_api import answer as embeddings_answer
from pipellm.services.gateway.embeddings_request import EmbeddingSettings, parse_embeddings
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.score_api import check_serves, rerank_answer, score_answer
from pipellm.services.gateway.score_pairs import pair_scores, pairs_message, truncate_pairs
from pipellm.services.gateway.score_request import parse_rerank, parse_score
from pipellm.services.tokenizer.embed import EmbedInputError, prepare_embed
from pipellm.shared.messages import EmbedRequest, EmbedResult

PooledAnswer = Callable[[EmbedResult], dict]  # a line's EmbedResult -> its body
REPLY_TO = "run-batch"  # EmbedCore's reply address: unused in process


def is_pooling_url(url: object) -> bool:
    """Whether `url` names a pooling API run-batch serves (vLLM's matchers)."""
    return isinstance(url, str) and (url == "/v1/embeddings" or url.endswith("/score")
                                     or url.endswith("/rerank"))


@dataclass
class PooledLine:
    """One pooling line: the EmbedRequest to run, how its result becomes the body, and the
    field an input's error names (`input`, `text_2` or `documents`)."""

    message: EmbedRequest
    answer: PooledAnswer
    param: str = "input"


class PoolingLines:
    """Pooling lines parsed as the gateway parses them and run in process: the tokenizer's
    `prepare_embed`, then compute's EmbedCore over all of them at once."""

    def __init__(self, engine, tokenizer, model_name: str,
                 settings: EmbeddingSettings | None, max_text_bytes: int):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.settings = settings or EmbeddingSettings()
        self.max_text_bytes = max_text_bytes

    def parse(self, url: str, body) -> PooledLine:
        """A line's PooledLine; an APIError where the body or the model cannot serve it."""
        settings, rid = self.settings, f"batch-{uuid.uuid4().hex}"
        if url == "/v1/embeddings":
            check_serves(settings, "Embeddings API")
            req = parse_embeddings(body, self.model_name, settings,
                                   max_text_bytes=self.max_text_bytes)
            if req.encoding.binary:  # a batch file's answers are JSON lines
                raise APIError(400, f"encoding_format {req.encoding.format} is not available "
                               "in a batch file (its answers are JSON)", param="encoding_format")
            return PooledLine(req.message(rid, REPLY_TO),
                              lambda result: embeddings_answer(result, req))
        limits = {"model_name": self.model_name, "max_model_len": settings.max_model_len,
                  "max_text_bytes": self.max_text_bytes}
        rerank = url.endswith("/rerank")
        check_serves(settings, "Rerank API" if rerank else "Score API", one_label=True)
        req = parse_rerank(body, **limits) if rerank else parse_score(body, **limits)
        scoring = settings.scoring

        def answer(result: EmbedResult) -> dict:
            scores, tokens = pair_scores(req, scoring, result), sum(result.num_tokens)
            return (rerank_answer(req, scores, tokens) if rerank
                    else score_answer(req.model, scores, tokens))

        cut = truncate_pairs(req, self.tokenizer.tok)
        return PooledLine(pairs_message(cut, scoring, rid, REPLY_TO), answer,
                          "documents" if rerank else "text_2")

    def run(self, lines: list[PooledLine]) -> list[dict | APIError]:
        """Each line's body, or its APIError, in line order."""
        out: list[dict | APIError | None] = [None] * len(lines)
        core, tok = EmbedCore(self.engine), self.tokenizer
        at: dict[str, int] = {}
        for i, line in enumerate(lines):
            try:
                core.submit(prepare_embed(tok.tok, line.message, tok.max_model_len,
                                          tok.vocab_size, tok.template))
                at[line.message.request_id] = i
            except EmbedInputError as e:
                out[i] = APIError(400, str(e), param=_param(e.param, line))
            except Exception as e:  # a bug costs one line, as in the tokenizer service
                out[i] = APIError(500, f"internal error in the tokenizer: {e}")
        results = []
        while core.has_work():  # a forward's worth of lines a run
            results.extend(result for _, result in core.run())
        for result in results:
            i = at[result.request_id]
            if result.error is not None:
                out[i] = APIError(result.error_status or 500, result.error,
                                  param=_param(result.error_param, lines[i]))
            else:
                out[i] = lines[i].answer(result)
        return out


def _param(param: str | None, line: PooledLine) -> str | None:
    """An input's error names the line's API field (as the gateway's score_api does)."""
    return line.param if param == "input" else param
