"""The bodies of vLLM's scoring APIs, validated: every failure a 400 naming its field.

- `/score`, `/v1/score`: `text_1` and `text_2`, each a string or a list of strings, paired as
  vLLM pairs them: one and one; one and N (text_1 with each of text_2); N and N (in order);
  a list of one text_1 counts as one.
- `/rerank`, `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's): `query` a string, `documents`
  strings or `{"text": ...}` objects, `top_n` (0 or absent: all; over the count: all),
  `return_documents` (default true, as vLLM's answers always hold them).
- `/classify`: `input` as /v1/embeddings takes it (strings or token ids).
All of them: at most MAX_PAIRS pairs (documents) a request, texts not empty and at most the
prompt size limit, `truncate_prompt_tokens` as /v1/embeddings; `user` accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.embeddings_request import parse_input, truncation
from services.gateway.errors import bad_request
from services.gateway.protocol import check_model
from services.gateway.validation import get_bool, get_int, get_str, json_type

MAX_PAIRS = 1024  # pairs (documents) one score or rerank request may hold
SCORE_KEYS = frozenset({"model", "text_1", "text_2", "truncate_prompt_tokens", "user"})
RERANK_KEYS = frozenset({"model", "query", "documents", "top_n", "return_documents",
                         "truncate_prompt_tokens", "user"})
CLASSIFY_KEYS = frozenset({"model", "input", "truncate_prompt_tokens", "user",
                           "add_special_tokens"})


@dataclass(frozen=True)
class PairsRequest:
    """A validated /score or /rerank request: its (text_1, text_2) pairs in order;
    `shared_first`: text_1 is one text, paired with every text_2 (a rerank's query)."""

    model: str
    pairs: tuple[tuple[str, str], ...]
    truncate_prompt_tokens: int = 0
    top_n: int = 0  # rerank: the best top_n results (0: all)
    return_documents: bool = True
    shared_first: bool = False


@dataclass(frozen=True)
class ClassifyRequest:
    """A validated /classify request: `texts` or `ids` (the other None)."""

    model: str
    texts: tuple[str, ...] | None
    ids: tuple[tuple[int, ...], ...] | None
    truncate_prompt_tokens: int = 0
    add_special_tokens: bool = True


def parse_score(body: Any, model_name: str, max_model_len: int, *, max_text_bytes: int,
                ignored: list[str] | None = None) -> PairsRequest:
    body = check_model(body, model_name, SCORE_KEYS, ignored)
    get_str(body, "user")
    first = _texts(body.get("text_1"), "text_1", max_text_bytes)
    second = _texts(body.get("text_2"), "text_2", max_text_bytes)
    if len(first) == 1:
        pairs = tuple((first[0], t) for t in second)
    elif len(first) == len(second):
        pairs = tuple(zip(first, second, strict=True))
    else:
        raise bad_request(f"text_1 and text_2 must hold as many texts (or text_1 one), got "
                          f"{len(first)} and {len(second)}", "text_2")
    return PairsRequest(get_str(body, "model", model_name), pairs,
                        truncation(body, max_model_len), shared_first=len(first) == 1)


def parse_rerank(body: Any, model_name: str, max_model_len: int, *, max_text_bytes: int,
                 ignored: list[str] | None = None) -> PairsRequest:
    body = check_model(body, model_name, RERANK_KEYS, ignored)
    get_str(body, "user")
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request(f"query must be a string, got {json_type(query)}", "query")
    query = _text(query, "query", "query", max_text_bytes)
    docs = body.get("documents")
    if not isinstance(docs, list):
        raise bad_request(f"documents must be a list of strings or of {{\"text\": ...}} "
                          f"objects, got {json_type(docs)}", "documents")
    docs = _count(docs, "documents")
    texts = tuple(_text(_document(d, i), f"documents[{i}]", "documents", max_text_bytes)
                  for i, d in enumerate(docs))
    return PairsRequest(get_str(body, "model", model_name), tuple((query, t) for t in texts),
                        truncation(body, max_model_len), get_int(body, "top_n", 0, lo=0),
                        get_bool(body, "return_documents", True), shared_first=True)


def parse_classify(body: Any, model_name: str, max_model_len: int, *, max_text_bytes: int,
                   ignored: list[str] | None = None) -> ClassifyRequest:
    body = check_model(body, model_name, CLASSIFY_KEYS, ignored)
    get_str(body, "user")
    texts, ids = parse_input(body.get("input"), max_text_bytes)
    return ClassifyRequest(get_str(body, "model", model_name), texts, ids,
                           truncation(body, max_model_len),
                           get_bool(body, "add_special_tokens", True))


def _texts(value: Any, param: str, max_bytes: int) -> tuple[str, ...]:
    """A string or a non-empty list of strings, as a tuple."""
    if isinstance(value, str):
        return (_text(value, param, param, max_bytes),)
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a string or a list of strings, got "
                          f"{json_type(value)}", param)
    return tuple(_text(v, f"{param}[{i}]", param, max_bytes)
                 for i, v in enumerate(_count(value, param)))


def _count(value: list, param: str) -> list:
    if not value:
        raise bad_request(f"{param} must not be empty", param)
    if len(value) > MAX_PAIRS:
        raise bad_request(f"{param} holds at most {MAX_PAIRS} items, got {len(value)}", param)
    return value


def _document(doc: Any, i: int) -> Any:
    """A document's text: the string, or an object's `text`."""
    if isinstance(doc, dict):
        if set(doc) - {"text"}:
            raise bad_request(f"documents[{i}] may only hold `text` (documents are texts)",
                              "documents")
        return doc.get("text")
    return doc


def _text(value: Any, where: str, param: str, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string, got {json_type(value)}", param)
    if not value:
        raise bad_request(f"{where} must not be an empty string", param)
    if len(value) > max_bytes // 4 and len(value.encode("utf-8")) > max_bytes:
        raise bad_request(f"{where} is longer than {max_bytes} bytes of UTF-8 text, the most "
                          "this server accepts (its --max-prompt-bytes)", param)
    return value
