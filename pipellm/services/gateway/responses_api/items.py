"""A Responses request's input items -> chat messages (the chat path's dicts), in order:

    message (roles user, system,          a message (input_text / output_text parts joined;
      developer, assistant)                 input_image / input_file: a 400)
    function_call, custom_tool_call       an assistant tool call (consecutive ones: one
                                            message; namespaced names flat, custom_tools.py)
    function_call_output,                 a `tool` message answering its call_id
      custom_tool_call_output
    reasoning                             the next assistant message's reasoning_content
"""

from __future__ import annotations

from typing import Any

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.responses_api import custom_tools, namespaces
from pipellm.services.gateway.validation import json_type


def input_items(raw: Any) -> list[dict]:
    """`input` as a list of items (a string: one user message)."""
    if raw is None:
        raise bad_request("input is required", "input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object, got {json_type(item)}",
                              f"input[{i}]")
    return [item if "type" in item else {"type": "message", **item} for item in raw]


def chat_messages(instructions: Any, items: list[dict]) -> list[dict]:
    """The chat messages of the instructions and the items, in order."""
    out: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    reasoning = None
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant",
                                  f"{where}.role")
            msg = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = _str(item, "call_id", where), _str(item, "name", where)
            if kind == "function_call":
                call = {"id": call_id, "type": "function", "function": {
                    "name": namespaces.history_name(item, name),
                    "arguments": _str(item, "arguments", where)}}
            else:
                call = custom_tools.call_message(item, name, call_id)
            last = out[-1] if out else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                        "content": output if isinstance(output, str)
                        else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise bad_request(f"{where}: input items of type {str(kind)[:40]!r} are not "
                              "supported (message, function_call, function_call_output, "
                              "custom_tool_call, custom_tool_call_output, reasoning)",
                              f"{where}.type")
    return out


def partial(item: dict) -> bool:
    """Whether `item` is an assistant message left unfinished (status in_progress or
    incomplete): a prefill the answer continues."""
    return (item.get("type") == "message" and item.get("role") == "assistant"
            and item.get("status") in ("in_progress", "incomplete"))


def _str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} (a string) is required", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of parts",
                          f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{kind} parts are not supported (text only)", at)
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise bad_request(f"{at} must be an input_text or output_text part", at)
    return "\n".join(texts)


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary (a 400 where a
    part's text is not a string)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        return ""
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    if not all(isinstance(t, str) for t in texts):
        raise bad_request("a reasoning item's content and summary parts need a string `text`",
                          "input")
    return "\n".join(texts)
