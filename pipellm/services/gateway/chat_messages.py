"""Chat messages of a request, validated: roles system (or developer, its newer name), user,
assistant (with `tool_calls`, its content then optional; `reasoning_content` or `reasoning`)
and tool (with `tool_call_id`);
content a string or text parts; the OpenAI fields we do not implement accepted only with the
values that ask for nothing (what clients echo back), anything else a 400 naming it; unknown
keys ignored (or, strict, a 400)."""

from __future__ import annotations

from typing import Any

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.validation import json_type, reject_unknown, same
from pipellm.shared.messages import ChatMessage, ToolCallMsg

_ROLES = ("system", "developer", "user", "assistant", "tool")
_OTHER_ROLES = ("function",)  # OpenAI roles we do not implement
# Message fields we do not implement; null (or an empty list) is what clients echo back.
_MESSAGE_NEUTRAL: dict[str, tuple] = {"function_call": (), "audio": (), "refusal": (),
                                      "annotations": ([],)}
# An assistant message's reasoning, as a reasoning parser answered it (vLLM's names; the
# chat template sees it as `reasoning_content`, as Qwen3's and DeepSeek-R1's read it).
_REASONING_KEYS = ("reasoning_content", "reasoning")
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                           *_REASONING_KEYS, *_MESSAGE_NEUTRAL})


def parse_messages(messages: Any, ignored: list[str] | None = None
                   ) -> tuple[ChatMessage, ...]:
    """Validated chat messages, as they travel to the tokenizers. Unknown keys of a message go
    to `ignored`, or without that list are a 400 (validation.reject_unknown)."""
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list):
        raise bad_request(f"messages must be an array, got {json_type(messages)}", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    return tuple(_parse_message(m, f"messages[{i}]", ignored) for i, m in enumerate(messages))


def _parse_message(message: Any, where: str, ignored: list[str] | None) -> ChatMessage:
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object, got {json_type(message)}", where)
    reject_unknown(message, _MESSAGE_KEYS, ignored, where)
    for key, harmless in _MESSAGE_NEUTRAL.items():
        value = message.get(key)
        if value is not None and not any(same(value, ok) for ok in harmless):
            raise bad_request(f"`{key}` in messages is not supported", f"{where}.{key}")
    role = message.get("role")
    if role is None:
        raise bad_request(f"{where} is missing `role`", f"{where}.role")
    if role not in _ROLES:
        what = f"`{role}` messages are not supported" if role in _OTHER_ROLES else (
            f"unknown role {str(role)[:50]!r}; expected one of {', '.join(_ROLES)}")
        raise bad_request(what, f"{where}.role")
    calls = _tool_calls(message.get("tool_calls"), role, f"{where}.tool_calls")
    content = message.get("content")
    call_id = message.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise bad_request(f"{where}.tool_call_id (a string) is required in tool messages",
                          f"{where}.tool_call_id")
    if role != "tool" and call_id is not None:
        raise bad_request("tool_call_id belongs to tool messages", f"{where}.tool_call_id")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request(f"{where}.name must be a string", f"{where}.name")
    return ChatMessage(role, "" if content is None and calls else
                       _content(content, f"{where}.content"), calls, call_id, name,
                       _reasoning(message, role, where))


def _reasoning(message: dict, role: str, where: str) -> str | None:
    """An assistant message's reasoning (either name; null: none)."""
    given = [(k, message[k]) for k in _REASONING_KEYS if message.get(k) is not None]
    if not given:
        return None
    key, value = given[0]
    if role != "assistant":
        raise bad_request(f"`{key}` belongs to assistant messages", f"{where}.{key}")
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {json_type(value)}",
                          f"{where}.{key}")
    return value


def _tool_calls(calls: Any, role: str, where: str) -> list[ToolCallMsg]:
    """An assistant message's calls (their arguments JSON text, as sent)."""
    if calls is None or calls == []:
        return []
    if role != "assistant":
        raise bad_request("tool_calls belong to assistant messages", where)
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(call.get("id"), str)
                and call.get("type", "function") == "function"
                and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise bad_request(f"{where}[{i}] must be {{\"id\", \"type\": \"function\", "
                              f"\"function\": {{\"name\", \"arguments\": string}}}}",
                              f"{where}[{i}]")
        out.append(ToolCallMsg(call["id"], fn["name"], fn["arguments"]))
    return out


def _content(content: Any, where: str) -> str:
    """A string, or a list of {"type": "text", "text": str} parts joined with newlines."""
    if content is None:
        raise bad_request(f"{where} is required", where)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content parts, "
                          f"got {json_type(content)}", where)
    texts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{at} must be an object with a string `type`", at)
        if part["type"] != "text":
            raise bad_request(f"content part type `{part['type'][:50]}` is not supported", at)
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise bad_request(f"{at} must be {{\"type\": \"text\", \"text\": string}}", at)
        texts.append(part["text"])
    return "\n".join(texts)
