"""Tool calling (chat): the request's `tools` / `tool_choice` / `parallel_tool_calls`, and the
generated text turned into OpenAI `tool_calls`, whole or streamed. vLLM's rules:

    tool_choice "none"       the tools are rendered (the template's `tools=`), the output is text
    tool_choice "auto"       (the default with tools) the model decides; its output is parsed by
                             the server's tool-call parser (tool_parsers.py; ChatSettings)
    tool_choice "required"   a grammar makes the output a JSON array of {"name", "parameters"},
                             one item per call (one at most without parallel_tool_calls): every
                             call names a given tool and its arguments validate
    a named function         a grammar makes the output that function's arguments (its schema)

Answers with calls end with finish_reason "tool_calls" (or "length" if cut off).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.tool_formats import PARSERS
from pipellm.services.gateway.tool_parsers import (
    CallArgs,
    CallStart,
    Content,
    ToolCall,
    new_call_id,
)
from pipellm.services.gateway.validation import get_bool, json_type
from pipellm.shared.grammar import GrammarSpec
from pipellm.shared.messages import ToolSpec

KEYS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ANY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """A request's tools and how it may call them (mode: none, auto, required, named)."""

    specs: tuple[ToolSpec, ...]
    mode: str
    named: str = ""
    parallel: bool = True
    parser: str = ""  # auto: --tool-call-parser

    @property
    def reads_special_tokens(self) -> bool:
        """Auto with a format whose marker is a special token (Mistral's [TOOL_CALLS]): the
        text keeps special tokens, as vLLM's mistral parser makes it."""
        return self.mode == "auto" and self.parser == "mistral"

    def grammar(self) -> GrammarSpec | None:
        """The output constraint of required / named, else None."""
        params = {t.name: json.loads(t.parameters) for t in self.specs}
        if self.mode == "named":
            return GrammarSpec("json_schema", json.dumps(params[self.named]), param="tool_choice")
        if self.mode != "required":
            return None
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                             "parameters": schema},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, schema in params.items()]}
        array = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(array), param="tools")

    def shaper(self) -> ToolShaper | None:
        return None if self.mode == "none" else ToolShaper(self)


def parse_tools(body: dict, auto_parser: str) -> Tools | None:
    """The request's Tools, or None without tools; `auto_parser`: the tool-call parser of
    tool_choice "auto", "" where the server turned auto off."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = get_bool(body, "parallel_tool_calls", True)
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad_request(f"tools must be an array, got {json_type(raw)}", "tools")
    specs = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [s.name for s in specs]
    if len(set(names)) < len(names):
        raise bad_request("tool names must be unique", "tools")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        specs, choice = _allowed(choice, specs)
        names = [s.name for s in specs]
    mode, named = _choice("auto" if choice is None else choice, names)
    if mode == "auto" and not auto_parser:
        raise bad_request('"auto" tool choice is off on this server (started with '
                          "--tool-call-parser but not --enable-auto-tool-choice, or with "
                          "--no-enable-auto-tool-choice)", "tool_choice")
    return Tools(specs, mode, named, parallel, auto_parser)


def _tool(tool: Any, where: str) -> ToolSpec:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type") != "function":
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    name, params = fn.get("name"), fn.get("parameters", _ANY_OBJECT)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ . -",
                          f"{where}.function.name")
    if not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          f"{where}.function.parameters")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string",
                          f"{where}.function.description")
    get_bool(fn, "strict", False)
    return ToolSpec(name, description, json.dumps(params))


def _allowed(choice: dict, specs: tuple[ToolSpec, ...]) -> tuple[tuple[ToolSpec, ...], str]:
    """OpenAI's tool_choice {"type": "allowed_tools", "allowed_tools": {"mode": "auto" or
    "required", "tools": [{"type": "function", "function": {"name"}}]}}: the model sees and
    may call only those tools (the others are left out of its prompt), in that mode."""
    spec = choice.get("allowed_tools")
    allowed = spec.get("tools") if isinstance(spec, dict) else None
    mode = spec.get("mode", "auto") if isinstance(spec, dict) else None
    if mode not in ("auto", "required") or not isinstance(allowed, list) or not allowed:
        raise bad_request('tool_choice allowed_tools must be {"mode": "auto" or "required", '
                          '"tools": [{"type": "function", "function": {"name": ...}}, ...]}',
                          "tool_choice")
    wanted, names = set(), {s.name for s in specs}
    for tool in allowed:
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request(f"tool_choice allows {str(name)[:64]!r}, which is not in tools",
                              "tool_choice")
        wanted.add(name)
    return tuple(s for s in specs if s.name in wanted), mode


def _choice(choice: Any, names: list[str]) -> tuple[str, str]:
    if choice in ("none", "auto", "required"):
        return choice, ""
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(fn, dict) and choice.get("type") == "function"
            and isinstance(fn.get("name"), str)):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": ...}}', "tool_choice")
    if fn["name"] not in names:
        raise bad_request(f"tool_choice names {fn['name'][:64]!r}, which is not in tools",
                          "tool_choice")
    return "named", fn["name"]


class ToolShaper:
    """One choice's output as content and tool calls: `whole(text)` at the end, or `feed` /
    `finish` while streaming (events of tool_parsers: Content, CallStart, CallArgs)."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.parser = PARSERS[tools.parser](tools.specs) if tools.mode == "auto" else None
        self.stream = self.parser.stream() if self.parser else None
        self.text = ""  # required: the array so far
        self.call_id = new_call_id()  # named
        self.calls = 0  # calls started (streaming)

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        mode = self.tools.mode
        if mode == "auto":
            return self.parser.parse(text)
        if mode == "named":
            return None, [ToolCall(self.call_id, self.tools.named, text)]
        try:
            items = json.loads(text)
        except ValueError:  # cut off by max_tokens: the calls that closed, else the text
            items = _closed_items(text)
            if not items:
                return text or None, []
        return None, [ToolCall(new_call_id(), it["name"], json.dumps(it["parameters"],
                                                                     ensure_ascii=False))
                      for it in items]

    def feed(self, text: str) -> list:
        mode = self.tools.mode
        if mode == "auto":
            return self._count(self.stream.feed(text))
        if mode == "named":
            start = [] if self.calls else [CallStart(0, self.call_id, self.tools.named)]
            self.calls = 1
            return start + ([CallArgs(0, text)] if text else [])
        self.text += text
        return []

    def finish(self) -> list:
        if self.tools.mode == "auto":
            return self._count(self.stream.finish())
        if self.tools.mode == "named":
            return self.feed("") if not self.calls else []
        content, calls = self.whole(self.text)
        events = [Content(content)] if content else []
        for i, call in enumerate(calls):
            events += [CallStart(i, call.id, call.name), CallArgs(i, call.arguments)]
        self.calls = len(calls)
        return events

    def _count(self, events: list) -> list:
        self.calls += sum(isinstance(e, CallStart) for e in events)
        return events


_ITEM_GAP = re.compile(r"[\s,]*")


def _closed_items(text: str) -> list:
    """The complete items of a JSON array cut off anywhere (the grammar made each one a valid
    call): a model that repeats its call until max_tokens still gets the calls it made."""
    decoder, items = json.JSONDecoder(), []
    pos = text.find("[") + 1
    while pos > 0:
        pos = _ITEM_GAP.match(text, pos).end()
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        items.append(item)
    return items
