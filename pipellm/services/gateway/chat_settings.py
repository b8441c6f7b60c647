"""A chat request's prompt options and the server's chat flags they depend on.

`ChatSettings` is the server's chat flags resolved once; `chat_options` reads a chat body's
prompt options into TokenizeRequest fields (continue_final_message, add_generation_prompt,
the template variables, a request's own template, the reasoning parser and its budget).
`/tokenize` reads the template variables the same way (`template_variables`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.request_fields import MAX_COUNT
from pipellm.services.gateway.validation import get_bool, get_int, get_str, json_type
from pipellm.shared.tool_prompt import auto_tool_parser


@dataclass(frozen=True)
class ChatSettings:
    """The server's chat flags, resolved once: the tool-call parser of tool_choice "auto"
    (--tool-call-parser with --enable-auto-tool-choice), --reasoning-parser,
    --default-chat-template-kwargs (a request's own chat_template_kwargs win key by key), and
    whether a request may bring its own `chat_template` (--trust-request-chat-template)."""

    tool_parser: str = ""
    reasoning_parser: str = ""
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    trust_request_template: bool = False

    @classmethod
    def of(cls, svc, template) -> ChatSettings:
        """From a ServiceConfig (its checks passed) and the model's chat template (None: it
        has none): pipellm/shared/tool_prompt.auto_tool_parser's rules."""
        return cls(auto_tool_parser(svc, template and template.source), svc.reasoning_parser,
                   json.loads(svc.default_chat_template_kwargs or "{}"),
                   svc.trust_request_chat_template)


NO_CHAT = ChatSettings()


def chat_options(body: dict, chat: ChatSettings) -> dict:
    """How a chat request's prompt renders and its reasoning is parsed: TokenizeRequest
    fields, and add_generation_prompt."""
    continue_final, add_generation_prompt = prompt_end(body, True)
    separate = get_bool(body, "separate_reasoning", True)
    budget = get_int(body, "thinking_token_budget", 0, lo=0, hi=MAX_COUNT)
    if budget and not chat.reasoning_parser:
        raise bad_request("thinking_token_budget needs the server started with "
                          "--reasoning-parser", "thinking_token_budget")
    kwargs = template_variables(body, chat.template_kwargs)
    return {"continue_final_message": continue_final,
            "add_generation_prompt": add_generation_prompt,
            "chat_template_kwargs": json.dumps(kwargs) if kwargs else "",
            "chat_template": request_template(body, chat),
            "reasoning_parser": chat.reasoning_parser if separate else "",
            "thinking_token_budget": budget}


def prompt_end(body: dict, add_by_default: bool) -> tuple[bool, bool]:
    """(continue_final_message, add_generation_prompt) of a chat body: the generation prompt
    by default where `add_by_default` and the last message is not continued; never both."""
    continue_final = get_bool(body, "continue_final_message", False)
    add_generation_prompt = get_bool(body, "add_generation_prompt",
                                     add_by_default and not continue_final)
    if continue_final and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                          "true", "continue_final_message")
    return continue_final, add_generation_prompt


def template_kwargs(body: dict) -> dict:
    """A body's chat_template_kwargs ({} when absent; a 400 unless an object)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request(f"chat_template_kwargs must be an object, got {json_type(kwargs)}",
                          "chat_template_kwargs")
    return kwargs or {}


def template_variables(body: dict, defaults: dict | None = None) -> dict:
    """A chat body's extra template variables: `defaults` (the server's), vLLM's `documents`
    (a RAG template's sources: a list of objects), then its chat_template_kwargs, which win
    key by key."""
    kwargs, docs = template_kwargs(body), body.get("documents")
    if docs is not None and not (isinstance(docs, list)
                                 and all(isinstance(d, dict) for d in docs)):
        raise bad_request("documents must be a list of objects", "documents")
    return {**(defaults or {}), **({"documents": docs} if docs is not None else {}),
            **kwargs}


def request_template(body: dict, chat: ChatSettings) -> str:
    """The request's own chat template ("" for the model's): vLLM's rule, only on a server
    that trusts them."""
    source = get_str(body, "chat_template", "")
    if source and not chat.trust_request_template:
        raise bad_request("Chat template is passed with request, but "
                          "--trust-request-chat-template is not set. Refused request with "
                          "untrusted chat template.", "chat_template")
    return source
