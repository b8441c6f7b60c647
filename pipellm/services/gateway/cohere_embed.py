"""Cohere's `POST /v2/embed` body and answer (vLLM serves it too), for text inputs.

- `texts`: 1..MAX_INPUTS non-empty strings; or `inputs`, each `{"content": [{"type": "text",
  "text": ...}, ...]}`, rendered as a user message with the model's chat template (vLLM's rule).
  `images` and image parts are a 400: pipellm serves text models.
- `input_type` (Cohere's SDK always sends one): the model's prompt of that name
  (PoolingConfig.prompts) prepended to each text, as sentence-transformers' `prompt_name`
  does (to `inputs`, a system message, as vLLM renders it); `search_query` and
  `search_document` also find a prompt named `query`, `document` or `passage`. A model
  without prompts embeds the texts as they are; one with prompts but none of that name is a
  400 that names the ones it has (vLLM's rule).
- `output_dimension`: as /v1/embeddings' `dimensions`.
- `truncate`: END (default: keeps the first tokens), START (the last ones), NONE; to
  `max_tokens` tokens when given, else to the context. NONE with `max_tokens`: an input over
  it is a 400 (vLLM's rule: checked once embedded).
- `embedding_types`: any of float (default), ubinary (a 1 bit for each value >= 0, 8 to a
  byte, MSB first), binary (those bytes less 128: Cohere's and vLLM's signed form), base64
  (little-endian float32).
The answer is Cohere's EmbedByTypeResponse: `id`, `embeddings` by type, `texts`, `meta`
(`api_version`, `billed_units.input_tokens`), `response_type` "embeddings_by_type".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipellm.services.gateway.chat_messages import parse_messages
from pipellm.services.gateway.embed_encoding import Encoding, rows_of
from pipellm.services.gateway.embeddings_chat import ChatInputs
from pipellm.services.gateway.embeddings_request import (
    MAX_INPUTS,
    EmbeddingSettings,
    EmbeddingsRequest,
    text_input,
)
from pipellm.services.gateway.errors import APIError, bad_request
from pipellm.services.gateway.protocol import check_model
from pipellm.services.gateway.validation import get_int, get_str, json_type
from pipellm.shared.messages import ChatMessage, EmbedResult

KEYS = frozenset({"model", "texts", "images", "inputs", "input_type", "output_dimension",
                  "embedding_types", "truncate", "max_tokens", "priority"})
TYPES = ("float", "binary", "ubinary", "base64")
TRUNCATE = ("END", "START", "NONE")
_PROMPT_NAMES = {"search_query": ("query",), "search_document": ("document", "passage")}


@dataclass(frozen=True)
class CohereEmbed:
    """A validated /v2/embed request: the embeddings request it makes, the types to answer
    with, the texts as sent, and (truncate NONE with max_tokens) the most tokens an input may
    have."""

    request: EmbeddingsRequest
    types: tuple[str, ...]
    texts: tuple[str, ...]
    max_tokens: int | None = None


def parse_cohere_embed(body: Any, model_name: str, settings: EmbeddingSettings, *,
                       max_text_bytes: int, ignored: list[str] | None = None) -> CohereEmbed:
    body = check_model(body, model_name, KEYS, ignored)
    if body.get("images") is not None:
        raise bad_request("`images` is not supported: this server embeds texts", "images")
    prefix = prompt_prefix(settings.config.prompts, get_str(body, "input_type"))
    chat = None
    if body.get("inputs") is not None and body.get("texts") is None:
        chat = ChatInputs(_conversations(body["inputs"], prefix))
        texts = tuple("".join(m.content for m in c if m.role == "user")
                      for c in chat.conversations)
    else:
        texts = _texts(body.get("texts"), max_text_bytes)
    dims = get_int(body, "output_dimension", lo=1)
    try:
        settings.check_dimensions(dims)
    except APIError as e:
        e.param = "output_dimension"
        raise
    types = _types(body.get("embedding_types"), dims or settings.config.dimension
                   or settings.hidden_size)
    truncate = get_str(body, "truncate", "END")
    if truncate not in TRUNCATE:
        raise bad_request(f"truncate must be one of {', '.join(TRUNCATE)}, got "
                          f"{truncate!r}"[:200], "truncate")
    max_tokens = get_int(body, "max_tokens", lo=1, hi=settings.max_model_len or None)
    k = 0 if truncate == "NONE" else max_tokens or -1
    req = EmbeddingsRequest(get_str(body, "model", model_name),
                            None if chat else tuple(prefix + t for t in texts), None,
                            dimensions=dims, truncate_prompt_tokens=k,
                            add_special_tokens=chat is None,
                            truncation_side="left" if truncate == "START" else "right",
                            chat=chat)
    return CohereEmbed(req, types, texts, max_tokens if truncate == "NONE" else None)


def prompt_prefix(prompts: tuple[tuple[str, str], ...], input_type: str | None) -> str:
    """The prefix `input_type` names among the model's `prompts` (see the module docstring)."""
    if input_type is None or not prompts:
        return ""
    named = dict(prompts)
    for name in (input_type, *_PROMPT_NAMES.get(input_type, ())):
        if name in named:
            return named[name]
    raise bad_request(f"Unsupported input_type {input_type!r}"[:200] + ". Supported values: "
                      + ", ".join(sorted(named)), "input_type")


def cohere_answer(result: EmbedResult, embed: CohereEmbed) -> dict:
    """Cohere's EmbedByTypeResponse for `result`; a 400 where truncate NONE's max_tokens is
    exceeded."""
    counts = list(result.num_tokens)
    if embed.max_tokens is not None and max(counts) > embed.max_tokens:
        i = max(range(len(counts)), key=counts.__getitem__)
        raise bad_request(f"Input of {counts[i]} tokens exceeds max_tokens={embed.max_tokens} "
                          "with truncate=NONE. Set truncate to END or START to allow "
                          "truncation.", "max_tokens")
    rows = np.stack(rows_of(result))
    embeddings: dict[str, list] = {}
    for kind in embed.types:
        if kind == "float":
            embeddings[kind] = rows.tolist()
        elif kind == "base64":
            embeddings[kind] = [Encoding("base64", endianness="little").json_value(row)
                                for row in rows]
        else:
            packed = np.packbits(rows >= 0, axis=1)
            signed = packed.astype(np.int16) - 128 if kind == "binary" else packed
            embeddings[kind] = signed.tolist()
    return {"id": result.request_id, "embeddings": embeddings, "texts": list(embed.texts),
            "meta": {"api_version": {"version": "2"},
                     "billed_units": {"input_tokens": sum(counts)}},
            "response_type": "embeddings_by_type"}


def _texts(value: Any, max_text_bytes: int) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise bad_request(f"texts must be a list of strings, got {json_type(value)}", "texts")
    if not value or len(value) > MAX_INPUTS:
        raise bad_request(f"texts must hold 1 to {MAX_INPUTS} strings, got {len(value)}",
                          "texts")
    return tuple(text_input(v, f"texts[{i}]", max_text_bytes, "texts")
                 for i, v in enumerate(value))


def _conversations(inputs: Any, prefix: str) -> tuple[tuple[ChatMessage, ...], ...]:
    """Cohere's `inputs` as conversations: the prefix as a system message (where there is
    one), then the input's text parts as the user's message."""
    if not isinstance(inputs, list) or not inputs or len(inputs) > MAX_INPUTS:
        raise bad_request(f"inputs must hold 1 to {MAX_INPUTS} objects", "inputs")
    out = []
    for i, item in enumerate(inputs):
        parts = item.get("content") if isinstance(item, dict) else None
        if not isinstance(parts, list) or not parts or any(
                not isinstance(p, dict) or p.get("type") != "text" for p in parts):
            raise bad_request(f"inputs[{i}] must be {{\"content\": [{{\"type\": \"text\", "
                              "\"text\": ...}]} (this server embeds texts)", "inputs")
        system = [{"role": "system", "content": prefix}] if prefix else []
        out.append(parse_messages(system + [{"role": "user", "content": parts}]))
    return tuple(out)


def _types(value: Any, width: int) -> tuple[str, ...]:
    """The embedding types asked for (default: float), each once."""
    if value is None:
        return ("float",)
    if not isinstance(value, list) or not value:
        raise bad_request("embedding_types must be a non-empty list", "embedding_types")
    for kind in value:
        if kind not in TYPES:
            raise bad_request(f"embedding_types: {str(kind)[:50]!r} is not one of "
                              f"{', '.join(TYPES)}", "embedding_types")
        if kind in ("binary", "ubinary") and width % 8:
            raise bad_request(f"{kind} embeddings need a width that is a multiple of 8, got "
                              f"{width}", "embedding_types")
    return tuple(dict.fromkeys(value))
