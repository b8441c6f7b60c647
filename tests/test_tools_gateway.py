"""The gateway's tools: tools / tool_choice / parallel_tool_calls -> Tools (and its grammar),
history messages with calls and results, and the ToolShaper that turns output into calls
(no services)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.protocol import parse_chat
from pipellm.services.gateway.tool_parsers import CallArgs, CallStart, Content
from pipellm.services.gateway.tools import Tools, parse_tools
from pipellm.shared.messages import ToolSpec

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]
MSG = [{"role": "user", "content": "hi"}]


def tools(**kw) -> Tools | None:
    return parse_tools({"tools": TOOLS, **kw}, "hermes")


def test_modes_and_defaults():
    assert tools().mode == "auto" and tools().parser == "hermes"
    assert tools(tool_choice="none").mode == "none" and tools(tool_choice="none").grammar() is None
    named = tools(tool_choice={"type": "function", "function": {"name": "add"}})
    assert (named.mode, named.named) == ("named", "add")
    assert json.loads(named.grammar().spec) == ADD and named.grammar().param == "tool_choice"
    assert parse_tools({}, "") is None and parse_tools({"tools": []}, "") is None
    assert tools().specs[1] == ToolSpec("now", "the time", '{"type": "object", "properties": {}}')
    # OpenAI's allowed_tools: only those tools, in the mode given
    only = tools(tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "now"}}]}})
    assert [s.name for s in only.specs] == ["now"] and only.mode == "required"
    assert json.loads(only.grammar().spec)["items"]["anyOf"][0]["properties"]["name"] == {
        "const": "now"}


@pytest.mark.parametrize("parallel, most", [(True, None), (False, 1)])
def test_required_is_an_array_of_calls_of_the_given_tools(parallel, most):
    schema = json.loads(tools(tool_choice="required", parallel_tool_calls=parallel)
                        .grammar().spec)
    assert schema.get("maxItems") == most and schema["minItems"] == 1
    jsonschema.validate([{"name": "add", "parameters": {"a": 1}}], schema)
    for bad in ([], [{"name": "sub", "parameters": {}}], [{"name": "add", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS}, "tool_choice"),  # auto by default, and no parser given
    ({"tools": "add"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "none"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "x"}}]}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "sometimes", "tools": []}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_400s(body, param):
    with pytest.raises(APIError) as e:
        parse_tools(body, "")
    assert e.value.status == 400 and e.value.param == param


def test_history_with_calls_and_results_reaches_the_tokenizer():
    messages = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "add",
                                                             "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    req = parse_chat({"messages": messages, "tools": TOOLS, "tool_choice": "none"}, "m")
    (out,) = req.tokenize_requests("r", "addr", 1, 0.0)
    assert [t.name for t in out.tools] == ["add", "now"] and out.grammar is None
    call = out.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "add", '{"a": 1}')
    assert out.messages[1].content == "" and out.messages[2].tool_call_id == "call_1"


def test_a_required_call_takes_the_place_of_the_output_constraint():
    req = parse_chat({"messages": MSG, "tools": TOOLS, "tool_choice": "required"}, "m")
    assert req.grammar.kind == "json_schema" and req.grammar.param == "tools"


def test_shapers():
    named = tools(tool_choice={"type": "function", "function": {"name": "add"}}).shaper()
    assert named.whole('{"a": 3}')[1][0].arguments == '{"a": 3}'
    events = named.feed('{"a"') + named.feed(": 3}") + named.finish()
    assert isinstance(events[0], CallStart) and events[0].name == "add"
    assert "".join(e.fragment for e in events if isinstance(e, CallArgs)) == '{"a": 3}'
    required = tools(tool_choice="required").shaper()
    text = '[{"name": "add", "parameters": {"a": 1}}, {"name": "now", "parameters": {}}]'
    content, calls = required.whole(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1}), ("now", {})]
    assert required.feed(text[:10]) == [] and len(required.feed(text[10:]) + required.finish()) == 4
    assert required.calls == 2
    cut = tools(tool_choice="required").shaper()
    assert cut.whole('[{"name": "ad') == ('[{"name": "ad', [])  # max_tokens: kept as text
    content, calls = cut.whole('[\n{"name": "add", "parameters": {"a": 1}},\n{"name": "add", '
                               '"parameters": {"a": 2}},\n{"name": "a')  # the closed calls
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"a": 1}, {"a": 2}]
    auto = tools().shaper()
    events = auto.feed("Hi. <tool_call>\n") + auto.feed('{"name": "now", "arguments": {}}\n'
                                                          "</tool_call>") + auto.finish()
    assert events[0] == Content("Hi. ") and auto.calls == 1


def test_the_built_in_chatml_tools_template(demo_model_dir):
    """--chat-template chatml_tools: the tools in the system turn, the assistant's calls as
    hermes <tool_call> blocks, consecutive tool results in one user turn."""
    from pipellm.shared.chat_template import load_chat_template

    template = load_chat_template(demo_model_dir, "chatml_tools")
    assert template.renders_tools and not load_chat_template(demo_model_dir).renders_tools
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    text = template.render(MSG + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
            {"id": "2", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "r1"},
        {"role": "tool", "tool_call_id": "2", "content": "r2"}], True, tools)
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>' in text
    assert text.count("<|im_start|>user") == 2 and "r1\n</tool_response>\n<tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_them_in_the_system_message(demo_model_dir):
    """pipellm/shared/tool_prompt.py (llama.cpp's fallback): the demo model's template renders no
    tools, so the tools and the Hermes call format go into the system message (the request's
    own kept before them), earlier calls into the assistant's text, consecutive tool results
    into one user turn; the tokenizer renders that with the model's own template."""
    from pipellm.services.tokenizer.service import Tokenizer
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.messages import ChatMessage, TokenizeRequest, ToolCallMsg, ToolSpec
    from pipellm.shared.sampling import SamplingParams
    from pipellm.shared.settings import with_settings
    from pipellm.shared.tool_prompt import tool_parser_for, with_tools

    assert tool_parser_for("{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_parser_for(None) == tool_parser_for("{{ messages }}") == "hermes"
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    calls = {"role": "assistant", "content": "Adding.", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}
    out = with_tools([{"role": "system", "content": "Be brief."}, *MSG, calls,
                      {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}],
                     tools)
    assert out[0]["content"].startswith("Be brief.\n\nYou may call") and '"add"' in \
        out[0]["content"]
    assert out[-2]["content"] == ('Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}'
                                  "\n</tool_call>") and "tool_calls" not in out[-2]
    assert out[-1] == {"role": "user", "content": "<tool_response>\nr1\n</tool_response>\n"
                                                  "<tool_response>\nr2\n</tool_response>"}
    tok = Tokenizer(with_settings(EngineConfig(), model=str(demo_model_dir)))
    req = TokenizeRequest("r", "gw", SamplingParams(max_tokens=4), messages=[
        ChatMessage("user", "2 + 3?"),
        ChatMessage("assistant", "", [ToolCallMsg("1", "add", '{"a": 2, "b": 3}')]),
        ChatMessage("tool", "5", tool_call_id="1")],
        tools=[ToolSpec("add", "Add", json.dumps(ADD))])
    text, ids = tok.prompt(req)
    assert "<tools>" in text and '"name": "add", "arguments": {"a": 2, "b": 3}' in text
    assert "<tool_response>\n5\n</tool_response>" in text and ids
