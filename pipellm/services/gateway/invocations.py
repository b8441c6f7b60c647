"""SageMaker's `POST /invocations`, as vLLM serves it on every server: the body goes to the API
whose request it reads as (vLLM tries its request types in turn, the first that validates
wins). A generation server: `messages` -> /v1/chat/completions, `prompt` ->
/v1/completions. A pooling server: `query` and `documents` -> /rerank; the sides of a /score
body -> /score; else `input` or `messages` -> the model's task (/v1/embeddings for an
embedder, /classify for a scoring head, /pooling for a reward model). Anything else is a 400
naming what it expects.
"""

from __future__ import annotations

from typing import Any

from pipellm.services.gateway.embeddings_request import EmbeddingSettings
from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.score_request import SCORE_SIDES

_TASK_PATHS = {"embed": "/v1/embeddings", "classify": "/classify", "token_classify": "/pooling"}


def invocation_path(body: Any, settings: EmbeddingSettings) -> str:
    """The API path that serves `body` on a server of `settings`; a 400 where none does."""
    given = set(body) if isinstance(body, dict) else set()
    if not settings.pooling:
        if "messages" in given:
            return "/v1/chat/completions"
        if "prompt" in given:
            return "/v1/completions"
        raise bad_request("Cannot find suitable handler for request. Expected one of: "
                          "ChatCompletionRequest (messages), CompletionRequest (prompt)")
    if {"query", "documents"} <= given:
        return "/rerank"
    if any(side[0] in given for side in SCORE_SIDES):
        return "/score"
    if given & {"input", "messages"}:
        return _TASK_PATHS[settings.task]
    raise bad_request("Cannot find suitable handler for request. Expected one of: "
                      "EmbeddingRequest / ClassificationRequest (input or messages), "
                      "RerankRequest (query, documents), ScoreRequest (queries, documents)")
