"""A model's generated text -> OpenAI tool calls, whole (parse) or streamed (stream), as vLLM's
`--tool-call-parser hermes` and `--tool-call-parser llama3_json` do. Pure logic, no I/O.

    hermes        `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one or more;
                  content is the text before the first `<tool_call>`
    llama3_json   after optional whitespace and `<|python_tag|>`: `{"name": "f", "parameters":
                  {...}}`, one or more joined by `;`; content None when they all parse

A call needs a non-empty string "name"; its arguments ("arguments", or for llama3_json also
"parameters") must be an object, or a string holding one's JSON; missing or null means {}.
ToolCall.arguments is always json.dumps(obj, ensure_ascii=False).

Invariant (tests/test_tool_parsers.py checks it over random texts and chunkings): for any text
and any split of it into chunks, the stream's Content texts concatenate to exactly
`parse(text)[0] or ""`, and its calls (CallStart name + CallArgs fragments) are parse's calls.
Whitespace-only content is None in parse and never emitted by the stream: the stream holds
leading whitespace back until a non-whitespace character of content follows it.

Where hermes differs from vLLM (so that streamed calls never have to be taken back):
  * vLLM turns the whole output into content when any block is bad; here only a bad *first*
    block does that. After a good call, a bad or unclosed block and everything after it are
    content (appended to the text before the first call); the good calls before it stay.
  * vLLM accepts a final `<tool_call>` without `</tool_call>`; here it is content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from pipellm.shared.reasoning import partial_marker

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WS = re.compile(r"\s*")


@dataclass(frozen=True)
class ToolCall:
    """One call. id: "call_" + 24 lowercase hex chars, unique; arguments: an object's JSON."""
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Content:
    """Stream event: text for message.content (never empty)."""
    text: str


@dataclass(frozen=True)
class CallStart:
    """Stream event: call number `index` (0, 1, ... in order) begins; precedes its CallArgs."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """Stream event: the next fragment of call `index`'s arguments JSON text."""
    index: int
    fragment: str


Event = Content | CallStart | CallArgs


def new_call_id() -> str:
    """A fresh ToolCall id: "call_" + 24 random lowercase hex chars."""
    return "call_" + secrets.token_hex(12)


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _json(text: str) -> object:
    """The JSON value of `text`, or None where it is not JSON (a JSON null is no call anyway)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _make_call(obj: object, keys: tuple[str, ...]) -> ToolCall | None:
    """The call that a decoded JSON value describes, or None if it is not a valid one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    args = {} if args is None else _json(args) if isinstance(args, str) else args
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _hermes_call(body: str) -> ToolCall | None:
    return _make_call(_json(body), ("arguments",))


class ToolParser:
    """Base of the parsers. parse() and stream() of one parser agree (see the module's
    invariant); a parser holds no state, a StreamParser holds one output's."""

    name: str

    def __init__(self, specs=()):
        """`specs`: the request's tools (ToolSpec), for formats that type values by schema."""
        self.specs = {s.name: s for s in specs}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content None when empty or whitespace."""
        raise NotImplementedError

    def stream(self) -> StreamParser:
        """A fresh StreamParser for one output."""
        raise NotImplementedError


class StreamParser:
    """One output, fed in chunks: feed() each chunk, then finish() once at the end. Text is
    never lost: what is not part of a call comes out as Content (except what the format drops:
    whitespace-only content, hermes text between and after calls)."""

    def __init__(self) -> None:
        self._held: str | None = ""  # content so far while all whitespace; None once begun
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        """The events that the output so far makes certain (possibly none)."""
        raise NotImplementedError

    def finish(self) -> list[Event]:
        """The rest of the events, at the end of the output."""
        raise NotImplementedError

    def _say(self, text: str, out: list[Event]) -> None:
        if self._held is not None:
            self._held += text
            if not self._held.strip():
                return
            text, self._held = self._held, None
        if text:
            out.append(Content(text))

    def _call(self, call: ToolCall, out: list[Event]) -> None:
        out += [CallStart(self._calls, call.id, call.name), CallArgs(self._calls, call.arguments)]
        self._calls += 1


class HermesParser(ToolParser):
    """Hermes 2 Pro / Qwen. Like vLLM, text between and after calls is dropped."""

    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        first = pos = text.find(OPEN)
        calls: list[ToolCall] = []
        while pos >= 0:
            end = text.find(CLOSE, pos + len(OPEN))
            call = _hermes_call(text[pos + len(OPEN):end]) if end >= 0 else None
            if call is None:  # with no calls yet (pos == first) this is the whole text
                return _content(text[:first] + text[pos:]), calls
            calls.append(call)
            pos = text.find(OPEN, end + len(CLOSE))
        return _content(text if first < 0 else text[:first]), calls

    def stream(self) -> StreamParser:
        return _HermesStream()


class _HermesStream(StreamParser):
    """Modes: "text" before the first call (content), "call" inside a block (the buffer starts
    with OPEN), "after" past a good call (text dropped), "content" past a bad block (all of it
    is content). Only a possible partial OPEN at the end of the buffer is held back."""

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode = "text"
        self._scan = len(OPEN)  # in "call" mode: where to look for CLOSE from

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._mode != "after":  # a held partial OPEN, an unclosed block: content
            self._say(self._buf, out)
        self._buf = ""
        return out

    def _step(self, out: list[Event]) -> bool:
        """Consume what the buffer allows in the current mode; True to run again."""
        buf = self._buf
        if self._mode == "content":
            self._say(buf, out)
            self._buf = ""
            return False
        if self._mode == "call":
            end = buf.find(CLOSE, self._scan)
            if end < 0:
                self._scan = max(len(OPEN), len(buf) - len(CLOSE) + 1)
                return False
            call = _hermes_call(buf[len(OPEN):end])
            if call is None:
                self._mode = "content"
                return True
            self._call(call, out)
            self._buf, self._mode = buf[end + len(CLOSE):], "after"
            return True
        start = buf.find(OPEN)
        keep = start if start >= 0 else len(buf) - partial_marker(buf, OPEN)
        if self._mode == "text":
            self._say(buf[:keep], out)
        self._buf = buf[keep:]
        if start < 0:
            return False
        self._mode, self._scan = "call", len(OPEN)
        return True


def _json_start(text: str) -> int | None:
    """Where llama3_json's first object would start: the index of its "{", -1 when `text` is
    plain content whatever follows, None while undecided (whitespace, and a prefix of
    `<|python_tag|>` or the tag and whitespace)."""
    rest = text[_WS.match(text).end():]
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG):]
        rest = rest[_WS.match(rest).end():]
    elif PYTHON_TAG.startswith(rest):
        return None
    if not rest:
        return None
    return len(text) - len(rest) if rest[0] == "{" else -1


def _json_calls(text: str, pos: int) -> list[ToolCall] | None:
    """The calls of `text[pos:]`: objects joined by ";" and whitespace; None unless all parse."""
    decoder, calls = json.JSONDecoder(), []
    while True:
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = _make_call(obj, ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
        pos = _WS.match(text, pos).end()
        if pos == len(text):
            return calls
        if text[pos] != ";":
            return None
        pos = _WS.match(text, pos + 1).end()


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling. All or nothing: either every object is a call (content
    None) or the whole text is content."""

    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = _json_start(text)
        calls = _json_calls(text, start) if start is not None and start >= 0 else None
        return (None, calls) if calls else (_content(text), [])

    def stream(self) -> StreamParser:
        return _Llama3Stream(self)


class _Llama3Stream(StreamParser):
    """Plain content streams as soon as the text's start shows it cannot be a call; once it
    starts with "{" everything waits for finish(), since a later failure makes all of it
    content (calls once emitted cannot be taken back)."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        super().__init__()
        self._parser = parser
        self._buf = ""
        self._plain = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._plain:
            self._say(text, out)
            return out
        self._buf += text
        if _json_start(self._buf) == -1:
            self._plain = True
            self._say(self._buf, out)
            self._buf = ""
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        content, calls = self._parser.parse(self._buf)
        self._buf = ""
        self._say(content or "", out)
        for call in calls:
            self._call(call, out)
        return out


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
