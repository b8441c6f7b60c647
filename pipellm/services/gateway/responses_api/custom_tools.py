"""Custom (freeform) tools of the Responses API, such as Codex's `apply_patch`, as vLLM serves
them: the model sees a function of one string argument, `input`; its call comes back as a
`custom_tool_call` item whose `input` is that string (streamed as
`response.custom_tool_call_input.delta` events, each a piece of it), and a history's
`custom_tool_call` / `custom_tool_call_output` items become that call and its result again.

Invariant: while a call's arguments stream in, `input_prefix` only grows, so the deltas joined
are the final input.
"""

from __future__ import annotations

import json
import re
from typing import Any

INPUT = "input"  # the argument the model writes a custom tool's input in
_KEY = json.dumps(INPUT)
_STRING = re.compile(r'(?:[^"\\]|\\.)*')  # a JSON string's body: up to an unescaped quote


def as_function(tool: dict) -> dict:
    """A custom tool as the chat path's function tool."""
    fn = {"name": tool.get("name"), "parameters": {
        "type": "object", "properties": {INPUT: {"type": "string"}}, "required": [INPUT]}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def custom_names(tools: list[dict]) -> frozenset[str]:
    """The names of the custom tools among a request's `tools`."""
    return frozenset(t.get("name") for t in tools if t.get("type") == "custom")


def encode_input(text: str) -> str:
    """A custom call's input as the function call's arguments."""
    return json.dumps({INPUT: text}, ensure_ascii=False)


def decode_input(arguments: str) -> str:
    """A finished call's input: the `input` string of its arguments (other text as it is)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(INPUT) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def input_prefix(arguments: str) -> str:
    """The longest part of the `input` string that `arguments` (a call's arguments so far)
    already spell out in full: escapes decoded, an unfinished escape left for later."""
    start = arguments.find(_KEY)
    if start < 0:
        return ""
    rest = arguments[start + len(_KEY):].lstrip()
    if not rest.startswith(":"):
        return ""
    rest = rest[1:].lstrip()
    if not rest.startswith('"'):
        return ""
    body = _STRING.match(rest, 1).group(0)  # up to the closing quote, if it has come
    for cut in range(len(body), max(len(body) - 6, -1), -1):  # \uXXXX is the longest escape
        try:
            text = json.loads('"' + body[:cut] + '"')
        except ValueError:
            continue
        return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text
    return ""


def call_message(item: dict, name: str, call_id: str) -> dict:
    """A `custom_tool_call` item as the assistant's function call."""
    text = item.get(INPUT)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": encode_input(
                text if isinstance(text, str) else "")}}


def is_call(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "custom_tool_call"
