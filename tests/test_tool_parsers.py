"""Tool-call parsers: whole outputs of both formats, and streaming agrees with parse() over any
chunking of any text (Content texts concatenate to the content, calls match by name and
arguments), with nothing lost."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipellm.services.gateway.tool_parsers import (
    PARSERS,
    CallArgs,
    CallStart,
    Content,
    HermesParser,
    Llama3JsonParser,
    ToolCall,
)

ID = re.compile(r"call_[0-9a-f]{24}")
HERMES, LLAMA = HermesParser(), Llama3JsonParser()


def hermes_block(name: str, args: object, key: str = "arguments") -> str:
    return f"<tool_call>\n{json.dumps({'name': name, key: args}, ensure_ascii=False)}\n</tool_call>"


def calls_of(calls: list[ToolCall]) -> list[tuple[str, object]]:
    for call in calls:
        assert ID.fullmatch(call.id)
    return [(c.name, json.loads(c.arguments)) for c in calls]


# -- hermes, whole outputs ---------------------------------------------------------------------

def test_hermes_single_call_no_content():
    content, calls = HERMES.parse(hermes_block("get_weather", {"city": "Paris"}))
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0].arguments == '{"city": "Paris"}'


def test_hermes_two_calls_and_content_before():
    text = ("Let me check both.\n\n" + hermes_block("a", {"x": 1}) + "\n"
            + hermes_block("b", {"y": [1, 2]}))
    content, calls = HERMES.parse(text)
    assert content == "Let me check both.\n\n"
    assert calls_of(calls) == [("a", {"x": 1}), ("b", {"y": [1, 2]})]


def test_hermes_unicode_and_nested_arguments():
    args = {"city": "東京", "opts": {"units": ["°C", "km/h"], "deep": {"n": None, "ok": True}}}
    content, calls = HERMES.parse(hermes_block("weather", args))
    assert content is None and calls_of(calls) == [("weather", args)]
    assert "東京" in calls[0].arguments  # ensure_ascii=False
    assert calls[0].arguments == json.dumps(args, ensure_ascii=False)


def test_hermes_whitespace_free_and_text_between_calls_dropped():
    text = '<tool_call>{"name":"a","arguments":{}}</tool_call> junk <tool_call>  {"name": "b"}  ' \
           '</tool_call> trailing'
    assert calls_of(HERMES.parse(text)[1]) == [("a", {}), ("b", {})]
    assert HERMES.parse(text)[0] is None


def test_hermes_arguments_missing_null_or_json_string():
    text = ('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b", "arguments": null}'
            '</tool_call><tool_call>{"name": "c", "arguments": "{\\"q\\":  \\"é\\"}"}</tool_call>')
    _, calls = HERMES.parse(text)
    assert [c.arguments for c in calls] == ["{}", "{}", '{"q": "é"}']


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>',  # bad JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
    '<tool_call>["a"]</tool_call>',
])
def test_hermes_bad_first_block_makes_everything_content(block):
    text = "Trying.\n" + block + hermes_block("b", {})
    assert HERMES.parse(text) == (text, [])


def test_hermes_bad_block_after_good_call_keeps_the_call():
    good, bad = hermes_block("a", {"x": 1}), '<tool_call>{"name": oops}</tool_call> tail'
    content, calls = HERMES.parse("Hi " + good + " dropped " + bad)
    assert calls_of(calls) == [("a", {"x": 1})]
    assert content == "Hi " + bad


def test_hermes_unclosed_tag_is_content():
    text = 'Sure <tool_call>\n{"name": "a", "arguments": {}}'
    assert HERMES.parse(text) == (text, [])
    content, calls = HERMES.parse(hermes_block("a", {}) + "<tool_call>{\"name")
    assert content == "<tool_call>{\"name" and calls_of(calls) == [("a", {})]


@pytest.mark.parametrize("text", ["Just an answer.", "a <tool_ca", "</tool_call> x", "é"])
def test_hermes_no_call(text):
    assert HERMES.parse(text) == (text, [])


@pytest.mark.parametrize("parser", [HERMES, LLAMA])
@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_empty_or_whitespace_is_none(parser, text):
    assert parser.parse(text) == (None, [])
    stream = parser.stream()
    assert stream.feed(text) + stream.finish() == []


# -- llama3_json, whole outputs ----------------------------------------------------------------

def test_llama3_single_call_with_python_tag_and_whitespace():
    for lead in ["", "  \n", "<|python_tag|>", " <|python_tag|> \n"]:
        text = lead + '{"name": "get_weather", "parameters": {"city": "東京"}}\n'
        content, calls = LLAMA.parse(text)
        assert content is None
        assert calls_of(calls) == [("get_weather", {"city": "東京"})]
        assert calls[0].arguments == '{"city": "東京"}'


def test_llama3_two_calls_nested_and_arguments_synonym():
    nested = {"q": {"filters": [{"k": "a", "v": [1, {"z": None}]}]}}
    text = '{"name": "a", "parameters": ' + json.dumps(nested) + '} ;\n {"name": "b", ' \
           '"arguments": {"y": 2}}'
    content, calls = LLAMA.parse(text)
    assert content is None and calls_of(calls) == [("a", nested), ("b", {"y": 2})]


@pytest.mark.parametrize("text", [
    '{"name": "a", "parameters": {"x": 1}',  # truncated
    '{"name": "a", "parameters": {}} and then some text',
    '{"name": "a", "parameters": {}}; ',  # ";" with no object after it
    '{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}',  # no ";"
    '{"answer": 42}',  # JSON, not a call
    '{"name": "a", "parameters": 3}',
    '{"name": "a", "parameters": {}}; {"nam": "b"}',
    'The answer is {"name": "a", "parameters": {}}',  # does not start with "{"
    '<|python_tag|>print(1)',
    '<|python_tag|',
    "Plain text.",
])
def test_llama3_not_calls_are_content(text):
    assert LLAMA.parse(text) == (text, [])


# -- ids, registry -----------------------------------------------------------------------------

def test_ids_unique_and_shaped():
    text = "".join(hermes_block(f"f{i}", {}) for i in range(50))
    ids = [c.id for _ in range(4) for c in HERMES.parse(text)[1]]
    ids += [e.id for e in (lambda s: s.feed(text) + s.finish())(HERMES.stream())
            if isinstance(e, CallStart)]
    assert len(ids) == 250 == len(set(ids))
    assert all(ID.fullmatch(i) for i in ids)


def test_registry():
    assert PARSERS == {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
    assert all(cls.name == key for key, cls in PARSERS.items())


# -- streaming ---------------------------------------------------------------------------------

def stream_events(parser, chunks: list[str]) -> list:
    stream = parser.stream()
    return [e for chunk in chunks for e in stream.feed(chunk)] + stream.finish()


def assemble(events: list) -> tuple[str, list[tuple[str, object]]]:
    """Content text and calls of a stream's events, checking their order and shape."""
    content, calls = "", []
    for event in events:
        if isinstance(event, Content):
            assert event.text
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls) and ID.fullmatch(event.id)
            calls.append([event.name, ""])
        else:
            assert isinstance(event, CallArgs) and event.index == len(calls) - 1
            calls[-1][1] += event.fragment
    return content, [(name, json.loads(args)) for name, args in calls]


def test_hermes_stream_is_prompt():
    s = HERMES.stream()
    assert s.feed("Sure, ") == [Content("Sure, ")]
    assert s.feed("I'll check <tool_") == [Content("I'll check ")]
    assert s.feed('call>\n{"name": "f", "arguments": {"a": 1}}\n') == []
    start, args = s.feed("</tool_call>")
    assert (start.index, start.name, args) == (0, "f", CallArgs(0, '{"a": 1}'))
    assert s.feed("\n<tool") == []
    assert s.finish() == []


def test_hermes_stream_releases_false_alarm_and_unclosed_block():
    s = HERMES.stream()
    assert s.feed("a <tool_c") == [Content("a ")]
    assert s.feed("x") == [Content("<tool_cx")]
    assert s.feed("<tool_call>{") == []
    assert s.finish() == [Content("<tool_call>{")]


def test_llama3_stream_plain_text_is_prompt_and_json_waits():
    s = LLAMA.stream()
    assert s.feed(" ") == [] and s.feed("<|py") == []
    assert s.feed("thon") == [] and s.feed("!") == [Content(" <|python!")]
    assert s.feed("x") == [Content("x")]
    s = LLAMA.stream()
    assert s.feed('{"name": "f", "parameters": {}}') == []
    start, args = s.finish()
    assert start.name == "f" and args == CallArgs(0, "{}")


ATOMS = ["<tool_call>", "</tool_call>", "<tool_c", "<tool_call", "</tool", "<|python_tag|>",
         "<|pyth", "{", "}", ";", "; ", " ", "\n", "Hi", "é東", "tool_call>", "\"", "}}",
         '{"name": "f", "arguments": {"x": [1, "<"]}}', '{"name": "g"}',
         '{"name": "h", "parameters": {"q": "東京"}}', '{"name": 1}', '{"name": "b", "arg']


@st.composite
def texts(draw):
    """Texts mixing call syntax, near misses and plain text, often well-formed outputs."""
    atoms = draw(st.lists(st.sampled_from(ATOMS), max_size=14))
    if draw(st.booleans()):
        calls = draw(st.lists(st.sampled_from(ATOMS[-5:-2]), min_size=1, max_size=3))
        if draw(st.booleans()):
            atoms += [f"<tool_call>{c}</tool_call>{draw(st.sampled_from(ATOMS))}" for c in calls]
        else:
            atoms = [draw(st.sampled_from(["", " ", "<|python_tag|>"])), "; ".join(calls)]
    return "".join(atoms) + draw(st.text(max_size=3))


@pytest.mark.parametrize("name", sorted(PARSERS))
@settings(max_examples=50, deadline=None)
@given(text=texts(), data=st.data())
def test_stream_matches_parse_for_any_chunking(name, text, data):
    parser = PARSERS[name]()
    content, calls = parser.parse(text)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=len(text) + 1)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for split in (chunks, list(text), [text]):
        assert assemble(stream_events(parser, split)) == (content or "", calls_of(calls))
