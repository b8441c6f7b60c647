"""Anthropic messages and their content blocks -> OpenAI chat messages (dicts, as a chat body
holds them; chat_messages.py validates them after).

Invariants: the blocks' order is kept (a user message's text blocks between tool_result
blocks become user messages between the `tool` messages); block fields the chat path has no
use for (cache_control, citations, is_error) are dropped; a block kind that would change the
answer if dropped (image, document) is a 400, never silently ignored. System text: the
top-level `system` and every message of role "system" (as vLLM merges them), one system
message first; Claude Code's `x-anthropic-billing-header` blocks left out (a per-request hash
in them would defeat the prefix cache; vLLM drops them too).
"""

from __future__ import annotations

import json
from typing import Any

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.validation import json_type

_UNSERVED = {"image": "images are not supported", "document": "documents are not supported"}
_BILLING = "x-anthropic-billing-header"
TOOL_CHANGES = ("tool_addition", "tool_removal")  # system blocks that change the tools
# assistant blocks of Anthropic's server tools in a history: their calls ran elsewhere
_SERVER_BLOCKS = frozenset({"server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                            "code_execution_tool_result", "bash_code_execution_tool_result",
                            "text_editor_code_execution_tool_result", "mcp_tool_use",
                            "mcp_tool_result", "container_upload"})


def chat_messages(system: Any, messages: Any, notes: list[str]) -> tuple[list[dict], bool]:
    """(the chat messages, whether the last one is an assistant prefill to continue)."""
    if not isinstance(messages, list):
        raise bad_request(f"messages must be an array, got {json_type(messages)}", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    systems = [] if system is None else [_system(system, "system")]
    out: list[dict] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role, content = message.get("role"), message.get("content")
        if role == "system":
            systems.append(_system(content, f"{where}.content"))
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f'{where}.role must be "user", "assistant" or "system"',
                              f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or an array of content "
                              f"blocks, got {json_type(content)}", f"{where}.content")
        blocks = [_block(b, f"{where}.content[{j}]") for j, b in enumerate(content)]
        out += _user(blocks, where) if role == "user" else [_assistant(blocks, where, notes)]
    if not out:
        raise bad_request("messages must hold a user or assistant message", "messages")
    system_text = "\n".join(t for t in systems if t)
    if system is not None or system_text:
        out.insert(0, {"role": "system", "content": system_text})
    last = out[-1]
    prefill = (last["role"] == "assistant" and not last.get("tool_calls")
               and bool(_text_of(last["content"]).strip()))
    return out, prefill


def _system(system: Any, where: str) -> str:
    """System text: a string, or text blocks joined by line breaks, without Claude Code's
    billing header."""
    if isinstance(system, str):
        return "" if system.startswith(_BILLING) else system
    if not isinstance(system, list):
        raise bad_request(f"{where} must be a string or an array of text blocks, got "
                          f"{json_type(system)}", where)
    blocks = [_block(b, f"{where}[{i}]") for i, b in enumerate(system)]
    texts = (_text(b, b[2]) for b in blocks if b[0] not in TOOL_CHANGES)  # request.py's
    return "\n".join(t for t in texts if not t.startswith(_BILLING))


def _block(block: Any, where: str) -> tuple[str, dict, str]:
    """(its type, the block, where it is), once it is an object with a string `type`."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where} must be a content block: an object with a string `type`",
                          where)
    kind = block["type"]
    if kind in _UNSERVED:
        raise bad_request(_UNSERVED[kind], where)
    return kind, block, where


def _text(block: tuple[str, dict, str], where: str) -> str:
    kind, b, _ = block
    if kind != "text":
        raise bad_request(f"{where}: expected a text block, got {kind[:40]!r}", where)
    return _string(b, "text", where)


def _string(b: dict, key: str, where: str) -> str:
    value = b.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {json_type(value)}",
                          f"{where}.{key}")
    return value


def _user(blocks: list[tuple[str, dict, str]], where: str) -> list[dict]:
    """A user message's blocks: text runs as user messages, tool results as tool messages."""
    out: list[dict] = []
    texts: list[dict] = []
    for kind, b, at in blocks:
        if kind == "text":
            texts.append({"type": "text", "text": _string(b, "text", at)})
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": _string(b, "tool_use_id", at),
                        "content": _result(b.get("content"), at)})
        elif kind != "tool_reference":  # outside a tool result it says nothing (as vLLM)
            raise bad_request(f"content blocks of type {kind[:40]!r} are not supported in "
                              "user messages", at)
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _result(content: Any, where: str) -> str:
    """A tool_result's content: a string or text blocks (joined by newlines); none is ""."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of text blocks",
                          f"{where}.content")
    return "\n".join(_result_text(_block(b, f"{where}.content[{i}]"))
                     for i, b in enumerate(content))


def _result_text(block: tuple[str, dict, str]) -> str:
    """A tool result's block as text: a text block's; a tool_reference (tool search's answer:
    the tool it found, whose definition the model has among its tools) as a line naming it."""
    kind, b, where = block
    if kind == "tool_reference":
        return f"Tool loaded: {_string(b, 'tool_name', where)}"
    return _text(block, where)


def _assistant(blocks: list[tuple[str, dict, str]], where: str, notes: list[str]) -> dict:
    """An assistant message's blocks as one message: text, tool calls, reasoning."""
    texts, calls, thinking = [], [], []
    for kind, b, at in blocks:
        if kind == "text":
            texts.append({"type": "text", "text": _string(b, "text", at)})
        elif kind == "tool_use":
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{at}.input must be an object", f"{at}.input")
            calls.append({"id": _string(b, "id", at), "type": "function", "function": {
                "name": _string(b, "name", at),
                "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "thinking":
            thinking.append(_string(b, "thinking", at))
        elif kind in _SERVER_BLOCKS:
            notes.append(f"{at}: a {kind} block is left out (server tools are not run here)")
        elif kind != "redacted_thinking":
            raise bad_request(f"content blocks of type {kind[:40]!r} are not supported in "
                              "assistant messages", at)
    out: dict[str, Any] = {"role": "assistant",
                           "content": texts if texts or not calls else None}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    return out


def _text_of(content: Any) -> str:
    """The text of a chat message's content (a string or text parts)."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content)
    return content or ""
