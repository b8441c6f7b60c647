"""Three more tool-call formats, beside tool_parsers.py's hermes and llama3_json, as vLLM's
parsers of the same names read them (formats from the models' chat templates):

    mistral       `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (Mistral 7B v0.3,
                  Mixtral), or `[TOOL_CALLS]name[ARGS]{...}` per call (tokenizer v11+,
                  Mistral Small 3.2, Magistral); content is the text before the first marker
    pythonic      the whole output a Python list of calls, `[f(a=1), g(b="x")]` (Llama 3.2
                  and 4's pythonic templates; Llama 4's `<|python_start|>...<|python_end|>`
                  around it too); arguments are Python literals
    qwen3_coder   `<tool_call><function=NAME><parameter=P>value</parameter>...</function>
                  </tool_call>` blocks (Qwen3-Coder); content is the text before the first;
                  a value is converted by its parameter's schema type (string, integer,
                  number, boolean, object, array; JSON if the schema does not say)

All or nothing, as vLLM's: when any call does not parse, the whole output is content.
Streaming: content streams until the format's opening shows, then the rest waits for the end
(calls once sent cannot be taken back); tool_parsers.py's invariant holds (the stream's content
and calls are parse's). Pure logic, no I/O.
"""

from __future__ import annotations

import ast
import json
import re

from pipellm.services.gateway import tool_parsers
from pipellm.services.gateway.tool_parsers import (
    Event,
    StreamParser,
    ToolCall,
    ToolParser,
    new_call_id,
)
from pipellm.shared.reasoning import partial_marker


def _call(name: object, args: object) -> ToolCall | None:
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


class _Opening(ToolParser):
    """A format whose calls begin at an opening marker: parse() and a stream that sends
    content up to it and the rest at the end."""

    def opening(self, text: str) -> int | None:
        """Where the calls start (index), -1 if they cannot (all content), None undecided."""
        raise NotImplementedError

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls of `text` (from its opening on); None unless all parse."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = self.opening(text)
        calls = self.calls(text[start:]) if start is not None and start >= 0 else None
        content = tool_parsers._content
        return (content(text[:start]), calls) if calls else (content(text), [])

    def stream(self) -> StreamParser:
        return _OpeningStream(self)


class _OpeningStream(StreamParser):
    def __init__(self, parser: _Opening) -> None:
        super().__init__()
        self._parser, self._buf, self._sent, self._plain = parser, "", 0, False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._plain:
            self._say(text, out)
            return out
        self._buf += text
        start = self._parser.opening(self._buf)
        if start == -1:
            self._plain = True
            self._say(self._buf[self._sent:], out)
            self._buf = ""
        else:  # content before the opening (or before a possible one) is certain
            safe = self._safe(start)
            self._say(self._buf[self._sent:safe], out)
            self._sent = max(self._sent, safe)
        return out

    def _safe(self, start: int | None) -> int:
        if start is not None:
            return start
        return len(self._buf) - max(self._parser.hold(self._buf), 0)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._plain:
            return out
        content, calls = self._parser.parse(self._buf)
        self._say((content or "")[self._sent:] if calls else self._buf[self._sent:], out)
        for call in calls:
            self._call(call, out)
        self._buf = ""
        return out


def _marker_opening(text: str, markers: tuple[str, ...]) -> int | None:
    """The first marker's index; None (undecided) while the text ends inside one."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else None


def _marker_hold(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may begin a marker."""
    return max(partial_marker(text, m) for m in markers)


class MistralParser(_Opening):
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def opening(self, text: str) -> int | None:
        return _marker_opening(text, (self.MARKER,))

    def hold(self, text: str) -> int:
        return _marker_hold(text, (self.MARKER,))

    def calls(self, text: str) -> list[ToolCall] | None:
        out: list[ToolCall] = []
        for part in text.split(self.MARKER)[1:]:
            if "[ARGS]" in part:  # v11+: name[ARGS]{...}
                name, _, args = part.partition("[ARGS]")
                try:
                    call = _call(name.strip(), json.loads(args))
                except ValueError:
                    return None
                if call is None:
                    return None
                out.append(call)
                continue
            try:
                items = json.loads(part)
            except ValueError:
                return None
            for item in items if isinstance(items, list) else [items]:
                call = isinstance(item, dict) and _call(item.get("name"),
                                                        item.get("arguments", {}))
                if not call:
                    return None
                out.append(call)
        return out or None


_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"


class PythonicParser(_Opening):
    name = "pythonic"

    def opening(self, text: str) -> int | None:
        start = tool_parsers._WS.match(text).end()
        rest = text[start:]
        if not rest or _PY_START.startswith(rest):
            return None
        return start if rest.startswith(("[", _PY_START)) else -1

    def hold(self, text: str) -> int:
        return len(text)  # undecided only while whitespace or a prefix of <|python_start|>

    def calls(self, text: str) -> list[ToolCall] | None:
        body = text.strip()
        if body.startswith(_PY_START):
            body = body[len(_PY_START):].removesuffix(_PY_END).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        out = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and not node.args and all(k.arg for k in node.keywords)):
                return None
            try:
                args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
            out.append(_call(node.func.id, args))
        return out


_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)
_OPENINGS = ("<tool_call>", "<function=")


class Qwen3CoderParser(_Opening):
    name = "qwen3_coder"

    def opening(self, text: str) -> int | None:
        return _marker_opening(text, _OPENINGS)

    def hold(self, text: str) -> int:
        return _marker_hold(text, _OPENINGS)

    def calls(self, text: str) -> list[ToolCall] | None:
        blocks = _FUNCTION.findall(text)
        rest = _FUNCTION.sub("", text).replace("<tool_call>", "").replace("</tool_call>", "")
        if not blocks or rest.strip():
            return None
        out = []
        for name, body in blocks:
            params = _PARAMETER.findall(body)
            if _PARAMETER.sub("", body).strip():
                return None
            out.append(_call(name, {p: self._value(name, p, v) for p, v in params}))
        return out

    def _value(self, tool: str, param: str, raw: str):
        """A parameter's text as its schema's type (vLLM's conversion; JSON where the schema
        does not say, the text itself where that fails)."""
        text = raw.removeprefix("\n").removesuffix("\n")
        spec = self.specs.get(tool)
        schema = json.loads(spec.parameters).get("properties", {}).get(param, {}) if spec \
            else {}
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string":
            return text
        try:
            value = json.loads(text)
        except ValueError:
            return text
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            return int(value)
        return value


PARSERS: dict[str, type[ToolParser]] = {
    **tool_parsers.PARSERS, "mistral": MistralParser, "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser}
