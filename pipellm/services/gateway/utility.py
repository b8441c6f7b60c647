"""The endpoints vLLM users script against besides generation: /tokenize, /detokenize,
/v1/models, /version and /ping, with vLLM's request and response shapes.

- `POST /tokenize`: `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...],
  "add_generation_prompt": true, "add_special_tokens": false}` (rendered with the chat
  template as a chat request would be, with its `tools`, `chat_template_kwargs`, `documents`
  and `continue_final_message`) -> `{"count", "max_model_len", "tokens", "token_strs"}`
  (`token_strs` with `"return_token_strs": true`, else null). Unknown keys are ignored and
  logged (or, with --strict-request-fields, a 400), as vLLM does.
- `POST /detokenize`: `{"tokens": [int, ...]}` -> `{"prompt": str}`, special tokens kept (the
  tokenizer's plain decode, as vLLM's).
- `GET /tokenizer_info` -> the tokenizer's special tokens, chat template and context length, as
  vLLM's (`--enable-tokenizer-info-endpoint` there; lm-eval's "remote" tokenizer reads it).
- `GET /v1/models`: the served model's card, then its LoRA adapters' (vLLM's: `parent` the
  base model, `root` the adapter's path); `GET /v1/models/{id}`: one card (OpenAI's retrieve;
  an unknown id is a 404 `model_not_found`).
- `GET /version` -> `{"version": str}`; `GET|POST /ping`: what /health answers.
"""

from __future__ import annotations

import asyncio
import logging
from importlib import metadata

from aiohttp import web

from pipellm.services.gateway.chat_messages import parse_messages
from pipellm.services.gateway.chat_settings import template_variables
from pipellm.services.gateway.errors import bad_request, unknown_model
from pipellm.services.gateway.json_body import check_prompt_bytes, read_json_body
from pipellm.services.gateway.protocol import check_model
from pipellm.services.gateway.tools import parse_tools
from pipellm.services.gateway.validation import get_bool, get_str, token_ids
from pipellm.shared.chat_template import ChatTemplate, ChatTemplateError, template_message
from pipellm.shared.tokenizer import decode, encode
from pipellm.shared.tool_prompt import render_chat, tool_dicts

TOKENIZE_KEYS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                           "add_generation_prompt", "return_token_strs", "continue_final_message",
                           "chat_template_kwargs", "documents", "tools", "tool_choice"})
DETOKENIZE_KEYS = frozenset({"model", "tokens"})
log = logging.getLogger("pipellm.gateway")
_INLINE_CHARS = 16 * 1024  # texts up to this size are tokenized on the event loop


def version() -> str:
    try:
        return metadata.version("pipellm")
    except metadata.PackageNotFoundError:
        return "unknown"


class Utility:
    """The handlers, over the gateway's tokenizer, chat template and model name."""

    def __init__(self, gateway):
        self.gw = gateway

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model:.+}", self.model)
        router.add_get("/version", self.version)
        router.add_get("/tokenizer_info", self.tokenizer_info)
        router.add_route("*", "/ping", self.gw.health_check)

    async def tokenize(self, request: web.Request) -> web.Response:
        ignored = None if self.gw.svc.strict_request_fields else []
        body = check_model(await read_json_body(request), self.gw.model_name, TOKENIZE_KEYS,
                           ignored, adapters=self.gw.adapter_names)
        if ignored:
            log.warning("/tokenize: fields present in the request but ignored: %s",
                        ", ".join(ignored))
        text = self._text(body)
        chat = body.get("messages") is not None
        special = get_bool(body, "add_special_tokens", not chat)
        ids = await _off_loop(len(text), encode, self.gw.tokenizer, text,
                              add_special_tokens=special)
        strs = None
        if get_bool(body, "return_token_strs", False):
            strs = [self.gw.tokenizer.id_to_token(i) for i in ids]
        return web.json_response({"count": len(ids), "max_model_len": self.gw.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    def _text(self, body: dict) -> str:
        """The text to tokenize: the prompt, or the messages rendered as chat renders them."""
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise bad_request("give either prompt or messages", "prompt")
        limit = self.gw.svc.prompt_bytes_limit(self.gw.max_model_len)
        if body.get("prompt") is not None:
            text = get_str(body, "prompt")
            check_prompt_bytes((text,) if text else (), None, limit)
            return text
        messages = parse_messages(body["messages"])
        check_prompt_bytes((), messages, limit)
        if self.gw.template is None:
            raise bad_request("this model has no chat template (see --chat-template)",
                              "messages")
        return _render(self.gw.template, body, [template_message(m) for m in messages])

    async def detokenize(self, request: web.Request) -> web.Response:
        body = check_model(await read_json_body(request), self.gw.model_name,
                           DETOKENIZE_KEYS, adapters=self.gw.adapter_names)
        if "tokens" not in body:
            raise bad_request("tokens is required", "tokens")
        ids = list(token_ids(body["tokens"], "tokens"))
        vocab = self.gw.tokenizer.get_vocab_size(with_added_tokens=True)
        if any(t >= vocab for t in ids):
            raise bad_request(f"token ids must be below the vocabulary size {vocab}", "tokens")
        text = await _off_loop(len(ids), decode, self.gw.tokenizer, ids,
                               skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        t = self.gw.template
        tokens = {} if t is None else {"bos_token": t.bos_token, "eos_token": t.eos_token,
                                       **t.extra_tokens}
        return web.json_response({"tokenizer_class": "PreTrainedTokenizerFast", **tokens,
                                  "chat_template": t and t.source,
                                  "model_max_length": self.gw.max_model_len})

    def _cards(self) -> list[dict]:
        gw = self.gw
        base = {"id": gw.model_name, "object": "model", "created": gw.created,
                "owned_by": "pipellm", "max_model_len": gw.max_model_len}
        return [base] + [{**base, "id": a.name, "root": a.path,
                          "parent": a.base_model_name or gw.model_name} for a in gw.adapters]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self._cards()})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        card = next((c for c in self._cards() if c["id"] == name), None)
        if card is None:
            raise unknown_model(name)
        return web.json_response(card)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version()})


def _render(template: ChatTemplate, body: dict, messages: list[dict]) -> str:
    """`messages` rendered as a chat request with this body's options renders them (the
    tokenizer service's rules: tools the template does not render go in the system message)."""
    continue_final = get_bool(body, "continue_final_message", False)
    add_prompt = get_bool(body, "add_generation_prompt", not continue_final)
    extra = template_variables(body)
    tools = parse_tools({"tools": body.get("tools"), "tool_choice": "none"}, "")
    try:
        return render_chat(template, messages, add_prompt, tool_dicts(tools and tools.specs),
                           extra or None, continue_final)
    except ChatTemplateError as exc:
        raise bad_request(str(exc)[:500], "messages") from None


async def _off_loop(size: int, fn, *args, **kwargs):
    """fn(*args, **kwargs), on a thread when the input is large (the loop serves meanwhile)."""
    if size <= _INLINE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))
