"""Tool calling through the real services on SmolLM2 with the official openai client: the
built-in chatml_tools template renders the tools, `required` and a named function are enforced
by a grammar (every call names a given tool and its arguments validate), `auto` parses the
model's own output (hermes); streamed calls assemble to the non-streamed answer; tool results
in the history are accepted; bad tools are 400s. The same server splits reasoning (qwen3's
parser: SmolLM2 never opens `<think>`, so its answers stay content; a regex makes it think).
Without a template that renders tools, or without --enable-auto-tool-choice, tools are 400s
(tests/test_structured_e2e.py's stack). Anthropic's Messages API (/v1/messages) runs on the
same server with the official anthropic SDK (its unit tests: tests/test_messages_api.py)."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import TOOLS_MODEL

MODEL = TOOLS_MODEL
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
def stack(tools_stack):
    return tools_stack  # tests/conftest.py: shared with tests/test_responses_e2e.py


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def claude(stack):
    """The official Anthropic SDK on the same server (/v1/messages)."""
    return anthropic.Anthropic(base_url=stack.url, api_key="-", max_retries=0)


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


# --- Anthropic's Messages API with the anthropic SDK -----------------------------------------

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
COLD = {"temperature": 0}  # this SDK has no temperature argument: sent in the body
A_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


def _same_usage(a, b) -> None:
    """Same output and prompt tokens (how many came from the prefix cache may differ)."""
    assert a.output_tokens == b.output_tokens
    assert a.input_tokens + a.cache_read_input_tokens == \
        b.input_tokens + b.cache_read_input_tokens


def test_messages_text_answer(claude):
    m = claude.messages.create(model=MODEL, max_tokens=30, messages=FRANCE, extra_body=COLD,
                               system=[{"type": "text", "text": "Answer briefly.",
                                        "cache_control": {"type": "ephemeral"}}])
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == MODEL and [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 0 < m.usage.output_tokens <= 30 and m.usage.cache_creation_input_tokens == 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 10


@pytest.mark.parametrize("kw, blocks", [
    ({}, ["text"]),
    ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "add"}}, ["tool_use"]),
    ({"tools": A_TOOLS, "tool_choice": {"type": "auto"}}, None),
    ({"extra_body": {**COLD, "guided_regex": THINKING}, "max_tokens": 80,  # made to think
      "messages": [{"role": "user", "content": "Think, then greet me."}]}, ["thinking", "text"]),
])
def test_messages_stream_assembles_to_the_whole_answer(claude, kw, blocks):
    args = {"model": MODEL, "max_tokens": 60, "extra_body": COLD,
            "messages": [{"role": "user", "content": QUESTIONS[1]}], **kw}
    whole = claude.messages.create(**args)
    assert blocks is None or [b.type for b in whole.content] == blocks
    with claude.messages.stream(**args) as stream:
        types = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason,
                                                               whole.stop_sequence)
    ids = [b.id for b in streamed.content if b.type == "tool_use"]
    assert all(i.startswith("toolu_") for i in ids)
    drop = {"id", "parsed_output"}
    assert [b.model_dump(exclude=drop) for b in streamed.content] == \
        [b.model_dump(exclude=drop) for b in whole.content]
    _same_usage(streamed.usage, whole.usage)


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "tool", "name": "add"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_messages_forced_tool_calls_validate(claude, choice):
    for seed, question in enumerate(QUESTIONS[:2]):
        m = claude.messages.create(model=MODEL, max_tokens=120, tools=A_TOOLS,
                                   tool_choice=choice, extra_body={"seed": seed},
                                   messages=[{"role": "user", "content": question}])
        assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
        use = m.content[0]
        assert use.id.startswith("toolu_") and isinstance(use.input, dict)
        assert choice["type"] == "any" or use.name == choice["name"]
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_messages_a_tool_result_in_the_history(claude):
    m = claude.messages.create(model=MODEL, max_tokens=40, tools=A_TOOLS, extra_body=COLD,
                               messages=[
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
             "input": {"city": "Paris", "unit": "C"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": '{"temperature": 21}'}]},
            {"type": "text", "text": "So?"}]}])
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use") and m.content


def test_messages_count_tokens(claude):
    short = claude.messages.count_tokens(model=MODEL, messages=FRANCE).input_tokens
    longer = claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "What is the capital of France? And of Spain? Of Italy?"}])
    with_tools = claude.messages.count_tokens(model=MODEL, messages=FRANCE, tools=A_TOOLS)
    assert 0 < short < longer.input_tokens < with_tools.input_tokens
    m = claude.messages.create(model=MODEL, max_tokens=2, messages=FRANCE, tools=A_TOOLS)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == with_tools.input_tokens


def test_messages_stop_sequence_and_max_tokens(claude):
    """The stop sequence is two words from the middle of SmolLM2's greedy answer to FRANCE (its
    text differs between float32 and bfloat16 activations, i.e. between CPUs). max_tokens is a
    ceiling, lowered to the context's room (8192 here): Claude Code asks for 32000 (streamed:
    the SDK refuses to wait that long for a whole answer)."""
    full = claude.messages.create(model=MODEL, max_tokens=40, messages=FRANCE,
                                  extra_body=COLD).content[0].text
    words = full.split()
    assert len(words) >= 8, full
    stop = " ".join(words[4:6])
    for max_tokens in (40, 20000):
        m = claude.messages.create(model=MODEL, max_tokens=max_tokens, messages=FRANCE,
                                   stop_sequences=["zzz", stop], extra_body=COLD)
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
        assert stop not in m.content[0].text
        assert m.content[0].text.rstrip() == full[:full.index(stop)].rstrip()
    with claude.messages.stream(model=MODEL, max_tokens=32000, messages=FRANCE,
                                stop_sequences=[stop], extra_body=COLD) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert [b.text for b in streamed.content] == [b.text for b in m.content]
    m = claude.messages.create(model=MODEL, max_tokens=3, messages=FRANCE, extra_body=COLD)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def _error(e: anthropic.APIStatusError, kind: str) -> str:
    assert e.body["type"] == "error" and e.body["error"]["type"] == kind
    return e.body["error"]["message"]


def test_messages_bad_requests(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": FRANCE})
    assert "max_tokens" in _error(e.value, "invalid_request_error")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
    assert "images are not supported" in _error(e.value, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus-4", max_tokens=5, messages=FRANCE)
    _error(e.value, "not_found_error")


# Claude Code's request, as recorded (trimmed: its system prompt and tools are long); a
# server tool, cache_control everywhere, thinking with a budget, metadata.user_id.
CLAUDE_CODE = {
    "model": MODEL, "max_tokens": 64, "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for "
                "Claude.", "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "You are an interactive CLI tool that helps users with "
                "software engineering tasks.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you "
         "can use the following context.\n</system-reminder>"},
        {"type": "text", "text": "List the files here.",
         "cache_control": {"type": "ephemeral"}}]}],
    "tools": [{"name": "Bash", "description": "Executes a given bash command.", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"command": {"type": "string", "description": "The command"},
                       "timeout": {"type": "number"}},
        "required": ["command"], "additionalProperties": False}},
        {"name": "Read", "description": "Reads a file.", "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
            "properties": {"file_path": {"type": "string"}}, "required": ["file_path"],
            "additionalProperties": False}, "cache_control": {"type": "ephemeral"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}],
    "metadata": {"user_id": "user_4f2a_account__session_9c1e"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
}


def _sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        kind, data = chunk.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        out.append((kind[7:], json.loads(data[6:])))
    return out


def test_messages_a_claude_code_request(stack):
    headers = {"content-type": "application/json", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-api-key": "-"}
    request = urllib.request.Request(stack.url + "/v1/messages?beta=true", headers=headers,
                                     data=json.dumps(CLAUDE_CODE).encode())
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r.read().decode())
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                    "message_stop"]
    assert all(k == data["type"] for k, data in events)
    usage = events[0][1]["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 50
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    names = {d["content_block"].get("name") for k, d in events if k == "content_block_start"}
    assert names <= {None, "Bash", "Read"}  # the server tool was never offered
    non_streamed = {**CLAUDE_CODE, "stream": False}
    m = anthropic.Anthropic(base_url=stack.url, api_key="-", max_retries=0).post(
        "/v1/messages", cast_to=anthropic.types.Message, body=non_streamed)
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens", "tool_use")
