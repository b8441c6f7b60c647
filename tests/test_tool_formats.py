"""The mistral, pythonic and qwen3_coder tool-call parsers
(pipellm/services/gateway/tool_formats.py) on outputs in the formats those models' chat templates
teach them, whole and streamed: the stream's content and calls equal the whole parse for every
chunking (tool_parsers.py's invariant), and a call that does not parse leaves the whole output as
content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipellm.services.gateway.tool_formats import PARSERS
from pipellm.services.gateway.tool_parsers import CallArgs, CallStart, Content
from pipellm.shared.messages import ToolSpec

SPECS = [ToolSpec("get_weather", "", json.dumps({"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "zip": {"type": "string"}, "tags": {"type": "array"}}}))]

CASES = {
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "add", "arguments": {"a": 1}}]',
         None, [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
        ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]add[ARGS]{}',
         "Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {})]),
        ("No tools needed: [TOOL_CALLS is not a marker.", "No tools needed: [TOOL_CALLS is "
         "not a marker.", []),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ', '[TOOL_CALLS][{"name": '
         '"get_weather", "arguments": {"city": ', []),  # cut off: all content
    ],
    "pythonic": [
        ('[get_weather(city="San Francisco", metric=True), add(a=1, b=[2, 3])]', None,
         [("get_weather", {"city": "San Francisco", "metric": True}),
          ("add", {"a": 1, "b": [2, 3]})]),
        ('<|python_start|>[get_weather(city="Rome")]<|python_end|>', None,
         [("get_weather", {"city": "Rome"})]),
        ("[1, 2] is a list, not a call.", "[1, 2] is a list, not a call.", []),
        ("The answer is 4.", "The answer is 4.", []),
        ("[f(x=open('a'))]", "[f(x=open('a'))]", []),  # not a literal: content
    ],
    "qwen3_coder": [
        ("I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
         "</parameter>\n<parameter=zip>\n01234\n</parameter>\n</function>\n</tool_call>",
         "I'll look it up.\n", [("get_weather", {"city": "New York", "days": 3, "metric": True,
                                                  "zip": "01234"})]),
        ("<tool_call>\n<function=get_weather>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=other>\n<parameter=x>\n{\"k\": 1}\n"
         "</parameter>\n</function>\n</tool_call>", None,
         [("get_weather", {"tags": ["a", "b"]}), ("other", {"x": {"k": 1}})]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", "<tool_call>\n"
         "<function=get_weather>\n<parameter=city>\nParis", []),  # unclosed: content
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def _parser(name):
    return PARSERS[name](SPECS)


@pytest.mark.parametrize("name,text,content,calls", ALL)
def test_whole_outputs(name, text, content, calls):
    got_content, got = _parser(name).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got)


def _streamed(name, chunks):
    stream, events = _parser(name).stream(), []
    for chunk in chunks:
        events += stream.feed(chunk)
    events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    starts = [(e.index, e.name) for e in events if isinstance(e, CallStart)]
    args = {}
    for e in events:
        if isinstance(e, CallArgs):
            args[e.index] = args.get(e.index, "") + e.fragment
    return content, [(n, json.loads(args[i])) for i, n in starts]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALL), st.lists(st.integers(0, 400), max_size=8))
def test_streams_equal_the_whole_parse_for_every_chunking(case, cuts):
    name, text, content, calls = case
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    assert _streamed(name, chunks) == (content or "", calls)


def test_content_streams_before_the_opening_shows():
    stream = _parser("qwen3_coder").stream()
    assert stream.feed("Sure, <tool") == [Content("Sure, ")]  # "<tool" may open a call
    assert stream.feed("box> is a word.") == [Content("<toolbox> is a word.")]
    stream = _parser("pythonic").stream()
    assert stream.feed("  [get_weather(") == [] and stream.feed('city="a")]') == []
    assert [type(e) for e in stream.finish()] == [CallStart, CallArgs]


def test_the_config_names_every_parser_and_templates_pick_theirs():
    from pipellm.shared.config import TOOL_CALL_PARSERS
    from pipellm.shared.tool_prompt import tool_parser_for

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    for mark, name in [("[TOOL_CALLS]", "mistral"), ("<function=", "qwen3_coder"),
                       ("[func_name1(params_name1=params_value1", "pythonic"),
                       ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json")]:
        assert tool_parser_for("{{ '" + mark + "' }}") == name


def test_mistral_auto_keeps_special_tokens_in_the_text():
    """[TOOL_CALLS] is a special token of Mistral's tokenizers: auto tool choice with the
    mistral parser keeps special tokens in the text (vLLM's rule); other formats do not."""
    from pipellm.services.gateway.chat_settings import ChatSettings
    from pipellm.services.gateway.protocol import parse_chat

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    for parser, skip in (("mistral", False), ("hermes", True)):
        req = parse_chat(body, "m", chat=ChatSettings(tool_parser=parser))
        assert req.options["skip_special_tokens"] is skip
    none = parse_chat({**body, "tool_choice": "none"}, "m", chat=ChatSettings("mistral"))
    assert none.options["skip_special_tokens"] is True
