"""Tool calling through the real services on SmolLM2 with the official openai client: the
built-in chatml_tools template renders the tools, `required` and a named function are enforced
by a grammar (every call names a given tool and its arguments validate), `auto` parses the
model's own output (hermes); streamed calls assemble to the non-streamed answer; tool results
in the history are accepted; bad tools are 400s. The same server splits reasoning (qwen3's
parser: SmolLM2 never opens `<think>`, so its answers stay content; a regex makes it think).
Without a template that renders tools, or without --enable-auto-tool-choice, tools are 400s
(tests/test_structured_e2e.py's stack)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from shared import default_model
from tests.stack import Stack

MODEL = "smol"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}
ADD = {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}},
         {"type": "function", "function": {"name": "add", "parameters": ADD,
                                           "description": "Add two integers"}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTIONS = ["What's the weather in Paris?", "What is 12 plus 30?", "Is it cold in Oslo?",
             "Sum 7 and 8 for me."]


@pytest.fixture(scope="module")
def client():
    s = Stack(default_model.fetch(), "--kv-cache-tokens", "8192", "--served-model-name", MODEL,
              "--chat-template", "chatml_tools", "--enable-auto-tool-choice",
              "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    s.start(timeout_s=300)
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
    s.stop()


def ask(client, question: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}],
        **{"tools": TOOLS, "max_tokens": 120, **kw})


def assert_valid(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_validate(client):
    for seed, question in enumerate(QUESTIONS):
        for temperature in (0.0, 1.0):
            choice = ask(client, question, tool_choice="required", parallel_tool_calls=False,
                         temperature=temperature, seed=seed).choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert len(choice.message.tool_calls) == 1
            assert_valid(choice.message.tool_calls)


def test_a_named_function_is_called(client):
    for seed, question in enumerate(QUESTIONS):
        choice = ask(client, question, temperature=1.0, seed=seed,
                     tool_choice={"type": "function", "function": {"name": "add"}}).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        assert_valid(choice.message.tool_calls)


def _assembled(stream) -> tuple[str, dict, str | None]:
    """(content, {index: (id, name, arguments)}, finish_reason) as the SDK's users assemble
    a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            cid, name, args = calls.get(call.index, ("", "", ""))
            calls[call.index] = (cid + (call.id or ""), name + (call.function.name or ""),
                                 args + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", "auto",
                                         {"type": "function", "function": {"name": "add"}}])
def test_the_stream_assembles_to_the_whole_answer(client, tool_choice):
    kw = dict(tool_choice=tool_choice, temperature=0.8, seed=3)
    whole = ask(client, QUESTIONS[1], **kw).choices[0]
    content, calls, finish = _assembled(ask(client, QUESTIONS[1], stream=True, **kw))
    assert finish == whole.finish_reason
    assert (content or None) == whole.message.content
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments))
        for c in whole.message.tool_calls or []]
    assert all(cid.startswith("call_") for cid, _, _ in calls.values())


def test_auto_with_a_call_in_the_history(client):
    """The hermes template renders the assistant's call and the tool's result; the answer
    is text or calls the parser found (each one valid JSON naming a given tool)."""
    messages = [{"role": "user", "content": QUESTIONS[0]},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    choice = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            max_tokens=60, temperature=0).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments),
                                                            dict)


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_400s(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "hi", **{"tools": TOOLS, **kw})
    assert e.value.body["param"] == param
    assert ask(client, "hi", tool_choice="none").choices[0].message.tool_calls is None


THINKING = r"<think>[a-z ]{10,60}</think>\n\n[A-Z][a-z ]{5,60}\."


def _think(client, extra=None, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think, then greet me."}],
        max_tokens=80, temperature=0, extra_body={"guided_regex": THINKING, **(extra or {})},
        **kw)


def test_reasoning_splits_streamed_and_whole(client):
    whole = _think(client).choices[0].message
    reasoning = whole.model_extra["reasoning"]
    assert reasoning and whole.model_extra["reasoning_content"] == reasoning
    assert "<think>" not in reasoning and "</think>" not in reasoning
    assert whole.content.startswith("\n\n") and whole.content.endswith(".")
    parts = {"reasoning": "", "content": ""}
    for chunk in _think(client, stream=True):
        delta = chunk.choices[0].delta
        for key in parts:
            parts[key] += (delta.model_extra.get(key) if key == "reasoning"
                           else delta.content) or ""
    assert parts == {"reasoning": reasoning, "content": whole.content}
    dropped = _think(client, extra={"include_reasoning": False}).choices[0].message
    assert dropped.content == whole.content and "reasoning" not in dropped.model_extra
    plain = ask(client, QUESTIONS[0], tool_choice="none", max_tokens=8).choices[0].message
    assert plain.content and plain.model_extra["reasoning"] is None  # never opened <think>
    again = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "Think, then greet me."},
        {"role": "assistant", "content": whole.content, "reasoning_content": reasoning},
        {"role": "user", "content": "Again."}])
    assert again.choices[0].message.content is not None
