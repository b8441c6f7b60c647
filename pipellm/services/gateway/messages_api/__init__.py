"""Anthropic's Messages API over the chat path: `POST /v1/messages` (what Claude Code and the
Anthropic SDKs speak) and `POST /v1/messages/count_tokens`.

A body is translated into the OpenAI chat body the gateway validates (request.py), generated
as any chat request, and answered in Anthropic's shapes (answer.py: the whole message;
events.py: the SSE stream). Errors under /v1/messages take Anthropic's error shape
(`error_body`, registered in app.ERROR_SHAPES).
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.json_body import check_prompt_bytes, read_json_body
from pipellm.services.gateway.messages_api.answer import error_body, message
from pipellm.services.gateway.messages_api.events import ANTHROPIC
from pipellm.services.gateway.messages_api.request import parse_request
from pipellm.shared.chat_template import ChatTemplate, ChatTemplateError, template_message
from pipellm.shared.messages import TokenizeRequest
from pipellm.shared.tokenizer import encode
from pipellm.shared.tool_prompt import with_tools

__all__ = ["MessagesAPI", "error_body", "message", "render_prompt"]
log = logging.getLogger("pipellm.gateway")


class MessagesAPI:
    """The handlers, over a Gateway (its settings, tokenizer, template and `_generate`)."""

    def __init__(self, gateway):
        self.gw = gateway

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", self.create)
        router.add_post("/v1/messages/count_tokens", self.count_tokens)

    def _parse(self, body, count_only: bool = False):
        gw = self.gw
        req, notes = parse_request(body, gw.model_name, defaults=gw.defaults,
                                   chat=gw.chat_settings, strict=gw.svc.strict_request_fields,
                                   count_only=count_only, adapters=gw.adapter_names)
        for note in notes:
            log.info("/v1/messages: %s", note)
        return req

    async def create(self, request: web.Request) -> web.StreamResponse:
        with self.gw.pending.hold():  # 429 past --max-pending, before anything is awaited
            req = self._parse(await read_json_body(request))
            return await self.gw._generate(request, req, ANTHROPIC)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """{"input_tokens": N}: the prompt a generation of this body would have, tokenized
        (the chat template renders the messages and the tools, as the tokenizers do)."""
        gw = self.gw
        req = self._parse(await read_json_body(request), count_only=True)
        check_prompt_bytes((), req.messages, gw.svc.prompt_bytes_limit(gw.max_model_len))
        if gw.template is None:
            raise bad_request("this model has no chat template (see --chat-template)",
                              "messages")
        one = req.tokenize_requests("count", "", 0, 0.0)[0]

        def count() -> int:
            return len(encode(gw.tokenizer, render_prompt(gw.template, one),
                              add_special_tokens=False))
        try:
            n = await asyncio.get_running_loop().run_in_executor(None, count)
        except ChatTemplateError as exc:
            raise bad_request(str(exc)[:500], "messages") from None
        return web.json_response({"input_tokens": n})


def render_prompt(template: ChatTemplate, req: TokenizeRequest) -> str:
    """A chat request's prompt text, as the tokenizer service renders it (its tools in the
    template's `tools=`, or for a template that renders none, in the system message)."""
    messages = [template_message(m) for m in req.messages]
    extra = json.loads(req.chat_template_kwargs) if req.chat_template_kwargs else None
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": json.loads(t.parameters)}}
        for t in req.tools or ()] or None
    if tools and not template.renders_tools:
        messages, tools = with_tools(messages, tools), None
    return template.render(messages, req.add_generation_prompt, tools, extra,
                           req.continue_final_message)
