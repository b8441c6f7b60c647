"""The bodies of vLLM's scoring APIs, validated: every failure a 400 naming its field.

- `/score`, `/v1/score`: two sides under any of vLLM's names for them (SCORE_SIDES:
  `queries` and `documents` or `items`, `data_1` and `data_2`, `text_1` and `text_2`), each a
  string or a list of strings, paired as vLLM pairs them: one and one; one and N (the first
  with each of the second); N and N (in order); a list of one first text counts as one.
- `/rerank`, `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's): `query` a string, `documents` a
  string or a list of strings or `{"text": ...}` objects, `top_n` (0 or absent: all; over the
  count: all), `return_documents` (default true, as vLLM's answers always hold them).
- Both: `max_tokens_per_query` and `max_tokens_per_doc` (0: no limit) cut each first and
  second text to that many tokens before they are paired (score_pairs.truncate_pairs);
  `instruction` (or `chat_template_kwargs.instruction`, which wins, vLLM's rule) replaces a
  Qwen3-Reranker's default instruction (other models have no use for it).
- `/classify`: `input` as /v1/embeddings takes it (strings or token ids).
All of them: at most MAX_PAIRS pairs (documents) a request, texts not empty and at most the
prompt size limit, `truncate_prompt_tokens` and `truncation_side` as /v1/embeddings,
`use_activation` (default true: the sigmoid or softmax of the head's logits; false: the
logits); `user` accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipellm.services.gateway.chat_settings import template_kwargs
from pipellm.services.gateway.embeddings_request import (
    client_id,
    parse_input,
    truncation,
    use_activation,
)
from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.protocol import check_model
from pipellm.services.gateway.validation import get_bool, get_int, get_str, json_type

MAX_PAIRS = 1024  # pairs (documents) one score or rerank request may hold
# vLLM's names for /score's first and second texts, the first pair present is taken
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))
_COMMON_KEYS = frozenset({"model", "user", "truncate_prompt_tokens", "truncation_side",
                          "use_activation", "request_id"})
_PAIR_KEYS = _COMMON_KEYS | {"max_tokens_per_query", "max_tokens_per_doc", "instruction",
                             "chat_template_kwargs"}
SCORE_KEYS = _PAIR_KEYS | {name for side in SCORE_SIDES for name in side}
RERANK_KEYS = _PAIR_KEYS | {"query", "documents", "top_n", "return_documents"}
CLASSIFY_KEYS = _COMMON_KEYS | {"input", "add_special_tokens"}


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
    truncation_side: str = "right"
    max_tokens: tuple[int, int] = (0, 0)  # max_tokens_per_query, max_tokens_per_doc (0: all)
    use_activation: bool = True
    instruction: str = ""  # a Qwen3-Reranker's instruction ("": its documented default)
    request_id: str | None = None  # the client's (vLLM's field): the answer's id


@dataclass(frozen=True)
class ClassifyRequest:
    """A validated /classify request: `texts` or `ids` (the other None)."""

    model: str
    texts: tuple[str, ...] | None
    ids: tuple[tuple[int, ...], ...] | None
    truncate_prompt_tokens: int = 0
    add_special_tokens: bool = True
    truncation_side: str = "right"
    use_activation: bool = True
    request_id: str | None = None


def parse_score(body: Any, model_name: str, max_model_len: int, *, max_text_bytes: int,
                ignored: list[str] | None = None) -> PairsRequest:
    body = check_model(body, model_name, SCORE_KEYS, ignored)
    get_str(body, "user")
    name_1, name_2 = score_sides(body)
    first = _texts(body.get(name_1), name_1, max_text_bytes)
    second = _texts(body.get(name_2), name_2, max_text_bytes)
    if len(first) == 1:
        pairs = tuple((first[0], t) for t in second)
    elif len(first) == len(second):
        pairs = tuple(zip(first, second, strict=True))
    else:
        raise bad_request(f"{name_1} and {name_2} must hold as many texts (or {name_1} one), "
                          f"got {len(first)} and {len(second)}", name_2)
    return PairsRequest(get_str(body, "model", model_name), pairs,
                        shared_first=len(first) == 1, **_pair_options(body, max_model_len))


def score_sides(body: dict) -> tuple[str, str]:
    """The names a /score body gives its two sides: the first of SCORE_SIDES it holds both
    of, else the first it holds one of (the other is missing), else text_1 and text_2."""
    given = [side for side in SCORE_SIDES if any(body.get(n) is not None for n in side)]
    whole = [side for side in given if all(body.get(n) is not None for n in side)]
    return (whole or given or [SCORE_SIDES[-1]])[0]


def _pair_options(body: dict, max_model_len: int) -> dict:
    """The options /score and /rerank share, as PairsRequest fields."""
    k, side = truncation(body, max_model_len)
    limits = tuple(get_int(body, name, 0, lo=0, hi=max_model_len or None)
                   for name in ("max_tokens_per_query", "max_tokens_per_doc"))
    return {"truncate_prompt_tokens": k, "truncation_side": side, "max_tokens": limits,
            "use_activation": use_activation(body), "instruction": _instruction(body),
            "request_id": client_id(body)}


def _instruction(body: dict) -> str:
    """vLLM's `instruction`, folded into chat_template_kwargs (whose own one wins)."""
    merged = {"instruction": get_str(body, "instruction"), **template_kwargs(body)}
    if merged["instruction"] is not None and not isinstance(merged["instruction"], str):
        raise bad_request("the instruction must be a string", "chat_template_kwargs")
    return merged["instruction"] or ""


def parse_rerank(body: Any, model_name: str, max_model_len: int, *, max_text_bytes: int,
                 ignored: list[str] | None = None) -> PairsRequest:
    body = check_model(body, model_name, RERANK_KEYS, ignored)
    get_str(body, "user")
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request(f"query must be a string, got {json_type(query)}", "query")
    query = _text(query, "query", "query", max_text_bytes)
    docs = body.get("documents")
    if isinstance(docs, str):
        docs = [docs]
    if not isinstance(docs, list):
        raise bad_request(f"documents must be a string, or a list of strings or of "
                          f"{{\"text\": ...}} objects, got {json_type(docs)}", "documents")
    docs = _count(docs, "documents")
    texts = tuple(_text(_document(d, i), f"documents[{i}]", "documents", max_text_bytes)
                  for i, d in enumerate(docs))
    return PairsRequest(get_str(body, "model", model_name), tuple((query, t) for t in texts),
                        top_n=get_int(body, "top_n", 0, lo=0),
                        return_documents=get_bool(body, "return_documents", True),
                        shared_first=True, **_pair_options(body, max_model_len))


def parse_classify(body: Any, model_name: str, max_model_len: int, *, max_text_bytes: int,
                   ignored: list[str] | None = None) -> ClassifyRequest:
    body = check_model(body, model_name, CLASSIFY_KEYS, ignored)
    get_str(body, "user")
    texts, ids = parse_input(body.get("input"), max_text_bytes)
    k, side = truncation(body, max_model_len)
    return ClassifyRequest(get_str(body, "model", model_name), texts, ids, k,
                           get_bool(body, "add_special_tokens", True), side,
                           use_activation(body), client_id(body))


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
