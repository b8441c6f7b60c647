"""OpenAI's `POST /v1/embeddings` body, validated: every failure a 400 naming its field.

- `input`: a string, a list of strings, a list of token ids, or a list of lists of token ids;
  none empty, at most MAX_INPUTS of them (OpenAI's and vLLM's 2048), each text at most the
  prompt size limit (--max-prompt-bytes). Or chat conversations, in `input` or `messages`
  (vLLM's): embeddings_chat.py.
- `encoding_format`, `embed_dtype`, `endianness` (vLLM's): embed_encoding.py.
- `dimensions`: a Matryoshka width the model gives (EmbeddingSettings.check_dimensions).
- `truncate_prompt_tokens` (vLLM's): keep k of each input's tokens; -1: the context length;
  `truncation_side` which: "right" (default, as vLLM's pooling runner and sentence-transformers
  truncate) the first k, "left" the last k.
- `add_special_tokens` (vLLM's; default true, for conversations false): the tokenizer's special
  tokens are added.
- `use_activation` (vLLM's): false, the pooled vectors unnormalized; true, L2-normalized;
  absent, as the model's pooling config says. vLLM's older `normalize` is a 400 naming it.
- `request_id` (vLLM's): the answer's id after the API's prefix (`embd-`), unless an
  X-Request-Id header names it (embeddings_api.message_id).
- `user` is accepted and ignored; other keys as --strict-request-fields says.
Token ids are checked against the vocabulary and the context by the tokenizer service.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pipellm.services.gateway import embed_encoding, embeddings_chat
from pipellm.services.gateway.embed_encoding import Encoding, parse_encoding
from pipellm.services.gateway.embeddings_chat import ChatInputs, parse_chat_inputs
from pipellm.services.gateway.errors import APIError, bad_request
from pipellm.services.gateway.protocol import check_model
from pipellm.services.gateway.request_fields import truncation_side
from pipellm.services.gateway.validation import (
    check_request_id,
    get_bool,
    get_int,
    get_str,
    is_int,
    json_type,
    token_ids,
)
from pipellm.shared.codec import int32s
from pipellm.shared.messages import EmbedRequest
from pipellm.shared.pooling import PoolingConfig
from pipellm.shared.scoring import ScoringConfig

MAX_INPUTS = 2048
KEYS = frozenset({"model", "input", "dimensions", "user", "truncate_prompt_tokens",
                  "truncation_side", "add_special_tokens", "use_activation", "normalize",
                  "request_id"}) | embeddings_chat.KEYS | embed_encoding.KEYS


@dataclass(frozen=True)
class EmbeddingSettings:
    """What the gateway knows of the served embedder: whether this is a pooling server, its
    pooling (Matryoshka widths) and its full width, the context length, its scoring head,
    whether it is a reward model (--convert reward: per-token outputs on /pooling only)."""

    pooling: bool = False
    config: PoolingConfig = dataclasses.field(default_factory=PoolingConfig)
    hidden_size: int = 0
    max_model_len: int = 0
    scoring: ScoringConfig = dataclasses.field(default_factory=ScoringConfig)  # its head
    reward: bool = False

    @property
    def task(self) -> str:
        """vLLM's name for what /pooling gives on this model: token_classify (a reward model:
        every token's rows), classify (a scoring head's probabilities), embed."""
        return "token_classify" if self.reward else "classify" if self.scoring.scores else "embed"

    def check_dimensions(self, dimensions: int | None) -> None:
        """400 on `dimensions` when the model cannot give that width."""
        if dimensions is None:
            return
        if self.reward:
            raise bad_request("dimensions is not supported by a reward model (it gives every "
                              "token's output, not an embedding)", "dimensions")
        try:
            self.config.output_dim(dimensions)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None
        if self.hidden_size and dimensions > self.hidden_size:
            raise bad_request(f"dimensions must be at most the model's width "
                              f"{self.hidden_size}, got {dimensions}", "dimensions")


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A validated embeddings request: `texts` or `ids` (the other None)."""

    model: str
    texts: tuple[str, ...] | None
    ids: tuple[tuple[int, ...], ...] | None
    encoding: Encoding = Encoding()
    dimensions: int | None = None
    truncate_prompt_tokens: int = 0
    add_special_tokens: bool = True
    truncation_side: str = "right"
    use_activation: bool | None = None  # None: the model's pooling config says
    chat: ChatInputs | None = None  # conversations instead of texts or ids
    request_id: str | None = None  # the client's (vLLM's field): the answer's id

    @property
    def count(self) -> int:
        if self.chat is not None:
            return len(self.chat.conversations)
        return len(self.texts if self.texts is not None else self.ids)

    def message(self, request_id: str, reply_to: str, task: str = "embed") -> EmbedRequest:
        """The EmbedRequest that asks the tokenizers (then compute) for this."""
        return EmbedRequest(request_id, reply_to, inputs=[int32s(ids) for ids in self.ids or ()],
                            texts=None if self.texts is None else list(self.texts),
                            dimensions=self.dimensions or 0,
                            truncate_prompt_tokens=self.truncate_prompt_tokens,
                            truncation_side=self.truncation_side,
                            add_special_tokens=self.add_special_tokens,
                            use_activation=self.use_activation, task=task,
                            **_chat_fields(self.chat))


def _chat_fields(chat: ChatInputs | None) -> dict:
    """The EmbedRequest fields of conversations."""
    if chat is None:
        return {}
    return {"conversations": [list(c) for c in chat.conversations],
            "add_generation_prompt": chat.add_generation_prompt,
            "continue_final_message": chat.continue_final_message,
            "chat_template_kwargs": chat.chat_template_kwargs}


def parse_embeddings(body: Any, model_name: str, settings: EmbeddingSettings, *,
                     max_text_bytes: int, ignored: list[str] | None = None,
                     ) -> EmbeddingsRequest:
    """The validated request (`ignored`: where unknown keys go; None: they are a 400)."""
    body = check_model(body, model_name, KEYS, ignored)
    get_str(body, "user")
    encoding = parse_encoding(body)
    dimensions = get_int(body, "dimensions", lo=1)
    settings.check_dimensions(dimensions)
    chat = parse_chat_inputs(body, ignored)
    texts, ids = parse_input(body.get("input"), max_text_bytes) if chat is None else (None, None)
    k, side = truncation(body, settings.max_model_len)
    return EmbeddingsRequest(get_str(body, "model", model_name), texts, ids, encoding,
                             dimensions, k, get_bool(body, "add_special_tokens", chat is None),
                             side, use_activation(body, None), chat, client_id(body))


def client_id(body: dict) -> str | None:
    """vLLM's `request_id` of a pooling request (the answer's id after its prefix)."""
    return check_request_id(get_str(body, "request_id"), "request_id")


def use_activation(body: dict, default: bool | None = True) -> bool | None:
    """vLLM's use_activation (a pooling head's activation: an embedding's normalization, a
    score's sigmoid, a classifier's softmax); its removed `normalize` is a 400."""
    if "normalize" in body:
        raise bad_request("Parameter `normalize` was removed; use `use_activation` instead.",
                          "normalize")
    return get_bool(body, "use_activation", default)


def truncation(body: dict, max_model_len: int) -> tuple[int, str]:
    """truncate_prompt_tokens: 0 (absent), -1 (to the context) or 1..the context length; and
    truncation_side (default "right")."""
    k = get_int(body, "truncate_prompt_tokens", 0, lo=-1)
    if k == 0 and body.get("truncate_prompt_tokens") is not None:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1",
                          "truncate_prompt_tokens")
    if max_model_len and k > max_model_len:
        raise bad_request(f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                          f"({max_model_len}). Please, select a smaller truncation size.",
                          "truncate_prompt_tokens")
    return k, truncation_side(body, "right")


def parse_input(value: Any, max_text_bytes: int
                ) -> tuple[tuple[str, ...] | None, tuple[tuple[int, ...], ...] | None]:
    """(texts, None) or (None, token id lists) of the accepted `input` shapes."""
    if value is None:
        raise bad_request("input is required", "input")
    if isinstance(value, str):
        return (text_input(value, "input", max_text_bytes),), None
    if not isinstance(value, list):
        raise bad_request(f"input must be a string, a list of strings, a list of token ids or "
                          f"a list of lists of token ids, got {json_type(value)}", "input")
    if not value:
        raise bad_request("input must not be empty", "input")
    if is_int(value[0]):
        return None, (_ids(value, "input"),)
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input holds at most {MAX_INPUTS} items, got {len(value)}", "input")
    if isinstance(value[0], str):
        return tuple(text_input(v, f"input[{i}]", max_text_bytes)
                     for i, v in enumerate(value)), None
    return None, tuple(_ids(v, f"input[{i}]") for i, v in enumerate(value))


def text_input(value: Any, where: str, max_bytes: int, param: str = "input") -> str:
    """`value` where it is a text input (a 400 on `param` otherwise). An empty string is
    one: it embeds where the tokenizer adds special tokens (BOS, CLS), else the tokenizer
    answers a 400 (no tokens), as vLLM and sentence-transformers treat it."""
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string like the other inputs, got "
                          f"{json_type(value)}", param)
    if len(value) > max_bytes // 4 and len(value.encode("utf-8")) > max_bytes:
        raise bad_request(f"{where} is longer than {max_bytes} bytes of UTF-8 text, the most "
                          "this server accepts (its --max-prompt-bytes)", param)
    return value


def _ids(value: Any, param: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a list of token ids like the other inputs, got "
                          f"{json_type(value)}", "input")
    if not value:
        raise bad_request(f"{param} must not be empty", "input")
    try:
        return token_ids(value, param)
    except APIError as e:  # every input's error names the field `input`
        e.param = "input"
        raise


_REMOVED_TASKS = {"score": "`score` task was removed; use `classify` instead.",
                  "encode": "`encode` task was removed; use `token_embed` or `token_classify` "
                            "instead."}


def pooling_task(body: Any, settings: EmbeddingSettings) -> str:
    """/pooling's `task` (taken out of `body`): absent or the model's own (settings.task), as
    vLLM serves one task a model; any other a 400."""
    task = body.pop("task", None) if isinstance(body, dict) else None
    if task is None or task == settings.task:
        return settings.task
    if task in _REMOVED_TASKS:
        raise bad_request(_REMOVED_TASKS[task], "task")
    raise bad_request(f"Unsupported task: {str(task)[:50]!r}. Supported tasks: "
                      f"('{settings.task}',)", "task")
