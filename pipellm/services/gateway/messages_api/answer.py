"""Anthropic's answer shapes: the whole message, its usage and stop reason, the error body.

A message's content blocks come in the order the model made them: thinking (with an empty
"signature": nothing here signs it), text, then tool_use blocks. Ids: the message's is
"msg_" + the request's id, a call's "toolu_" + the tool parser's call id.
"""

from __future__ import annotations

import json

from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.inflight import ChoiceState
from pipellm.services.gateway.protocol import GenerationRequest
from pipellm.services.gateway.tool_parsers import ToolCall

# HTTP status -> Anthropic's error type (others: invalid_request_error below 500, else api_error)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(err: APIError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, typed by the HTTP status."""
    kind = _ERROR_TYPES.get(err.status) or (
        "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def message_id(request_id: str) -> str:
    """"msg_" + the request's own id (the gateway names chat requests "chatcmpl-...")."""
    return "msg_" + request_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(c: ChoiceState, called: bool) -> str:
    """Why the message ended: max_tokens (the length ran out, calls or not), tool_use (it
    called tools), stop_sequence (a stop string matched), else end_turn."""
    if c.finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if c.stop_string else "end_turn"


def stop_fields(c: ChoiceState, called: bool) -> dict:
    """{"stop_reason", "stop_sequence"} (the matched string, with stop_sequence alone)."""
    reason = stop_reason(c, called)
    return {"stop_reason": reason,
            "stop_sequence": c.stop_string if reason == "stop_sequence" else None}


def usage(c: ChoiceState) -> dict:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the prefix cache
    (cache_read_input_tokens), as Anthropic counts them; nothing is written to a cache on
    request, so cache_creation_input_tokens is 0."""
    return {"input_tokens": c.num_prompt - c.cached_tokens, "output_tokens": len(c.token_ids),
            "cache_read_input_tokens": c.cached_tokens, "cache_creation_input_tokens": 0}


def tool_input(arguments: str) -> dict:
    """A call's input object; arguments cut off by max_tokens (not JSON) give {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": tool_input(call.arguments)}


def content_of(req: GenerationRequest, c: ChoiceState) -> tuple[str, list[ToolCall]]:
    """A finished choice's text and tool calls, as the chat path's answer has them."""
    text = "".join(c.text)
    shaper = req.tools.shaper() if req.tools is not None else None
    if shaper is None:
        return text, []
    content, calls = shaper.whole(text)
    return content or "", calls


def message(tokenizer, req: GenerationRequest, request_id: str,
            choices: list[ChoiceState]) -> dict:
    """The non-streamed answer of a finished request (one choice), as stream.final_answer
    builds chat's: usable without HTTP (run-batch). `tokenizer` is unused, kept so that it
    is called as final_answer is."""
    del tokenizer
    c = choices[0]
    text, calls = content_of(req, c)
    blocks = []
    reasoning = "".join(c.reasoning) if req.shows_reasoning else ""
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text:
        blocks.append({"type": "text", "text": text})
    blocks += [tool_use_block(call) for call in calls]
    if not blocks:  # Anthropic's shape of an empty answer (clients read content[0])
        blocks.append({"type": "text", "text": ""})
    return {"id": message_id(request_id), "type": "message", "role": "assistant",
            "model": req.model, "content": blocks, **stop_fields(c, bool(calls)),
            "usage": usage(c)}
