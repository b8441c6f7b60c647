"""OpenAI's Responses API through the real services on SmolLM2 (tests/conftest.py's
tools_stack) with the official openai SDK and the OpenAI Agents SDK: answers whole and
streamed (the same at temperature 0), stored and retrieved, chained by previous_response_id,
function calls forced by the grammar and answered, background responses polled, streamed again
from any event, cancelled and deleted, and continued across a kill -9 of compute and of the
gateway; and a streamed Anthropic message and a streamed chat answer split by the reasoning
parser across a kill -9 of compute (the unit tests:
tests/test_responses_api.py, tests/test_messages_api.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import anthropic
import jsonschema
import openai
import pytest

from tests.conftest import TOOLS_MODEL as MODEL
from tests.test_structured_e2e import run_weather_agent

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER}
HELLO = "Say hello in one short sentence."
STORY = "Tell me a long story about a dragon."


@pytest.fixture(scope="module")
def client(tools_stack):
    return openai.OpenAI(base_url=tools_stack.url + "/v1", api_key="-", max_retries=0)


def create(client, text=HELLO, **kw):
    return client.responses.create(model=MODEL, input=text,
                                   **{"max_output_tokens": 60, "temperature": 0, **kw})


def wait(client, rid: str, timeout_s: float = 300,
         until=lambda r: r.status not in ("queued", "in_progress")):
    """Poll a background response until `until` (default: until it ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.responses.retrieve(rid)
        if until(r):
            return r
        assert time.monotonic() < deadline, f"{rid} still {r.status}"
        time.sleep(0.2)


def test_whole_streamed_stored_and_chained(client):
    whole = create(client)
    assert whole.status == "completed" and whole.output_text.strip()
    assert whole.usage.output_tokens > 0 and whole.output[0].type == "message"
    with client.responses.stream(model=MODEL, input=HELLO, max_output_tokens=60,
                                 temperature=0) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    kinds = [event.type for event in events]
    assert streamed.output_text == whole.output_text
    # the SDK's snapshot: the items as added plus the deltas since
    snapshots = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert snapshots[-1] == whole.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    got = client.responses.retrieve(whole.id)
    assert got.output_text == whole.output_text and got.status == "completed"
    items = client.responses.input_items.list(whole.id)
    assert [i.type for i in items.data] == ["message"]
    second = create(client, "Now say it in French.", previous_response_id=whole.id)
    assert second.status in ("completed", "incomplete") and second.output_text
    # the second prompt holds the first turn: its input and its answer
    assert second.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
    assert second.previous_response_id == whole.id


def test_a_forced_function_call_and_its_output(client):
    r = create(client, "What's the weather in Paris?", tools=[TOOL], tool_choice="required",
               parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    answer = create(client, [{"type": "function_call_output", "call_id": calls[0].call_id,
                              "output": "Sunny, 24 C"}], previous_response_id=r.id,
                    tools=[TOOL], tool_choice="none")
    assert answer.output_text and answer.output[0].type == "message"


def test_a_custom_tool_call_streamed_and_answered(client):
    """A custom (freeform) tool, as Codex's apply_patch is sent: the forced call comes back
    as a custom_tool_call whose streamed input deltas join to its input, and its output
    chains on."""
    patch = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to a file"}
    with client.responses.stream(model=MODEL, input="Rename x to y in a.py", tools=[patch],
                                 tool_choice={"type": "custom", "name": "apply_patch"},
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        r = stream.get_final_response()
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert call.name == "apply_patch" and isinstance(call.input, str)
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == call.input
    answer = create(client, [{"type": "custom_tool_call_output", "call_id": call.call_id,
                              "output": "Done"}], previous_response_id=r.id, tools=[patch],
                    tool_choice="none")
    assert answer.output_text and answer.output[0].type == "message"


def test_built_in_tools_are_skipped_and_bad_input_is_a_400(client):
    r = create(client, tools=[{"type": "web_search_preview"}, TOOL])
    assert r.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as err:
        create(client, [{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])
    assert err.value.body["param"] == "input[0].content[0]"
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_background_polled_replayed_cancelled_and_deleted(client):
    b = create(client, background=True)
    assert b.status in ("queued", "in_progress")
    done = wait(client, b.id)
    assert done.status == "completed" and done.output_text == create(client).output_text
    events = list(client.responses.retrieve(b.id, stream=True, starting_after=4))
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(5, 5 + len(seqs))) and events[-1].type == "response.completed"
    everything = list(client.responses.retrieve(b.id, stream=True))
    text = "".join(e.delta for e in everything if e.type == "response.output_text.delta")
    assert text == done.output_text and everything[-1].response.output_text == text
    long = create(client, STORY, background=True, max_output_tokens=6000)
    running = wait(client, long.id, until=lambda r: r.output_text)  # generating: cancel it
    assert running.status == "in_progress"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and wait(client, long.id).status == "cancelled"
    client.responses.delete(b.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(b.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(create(client).id)  # only background ones


def test_the_agents_sdk_over_the_responses_api(tools_stack):
    """An agent with one function tool on OpenAIResponsesModel calls it (arguments valid) and
    ends with its output (stop_on_first_tool: after a tool result this 135M model repeats
    `<tool_response>` until max_output_tokens, which the SDK raises on as `incomplete`; a
    tool result answered by the model is test_a_forced_function_call_and_its_output's)."""
    calls, result = run_weather_agent(tools_stack.url, "OpenAIResponsesModel", MODEL,
                                      tool_use_behavior="stop_on_first_tool")
    assert len(calls) == 1 and calls[0]
    assert result.final_output == f"Sunny and 24 C in {calls[0]}."


def _kill(stack, service: str) -> None:
    os.kill(stack.pid(service), signal.SIGKILL)


@pytest.mark.parametrize("service", ["compute", "gateway"])
def test_a_background_response_survives_a_kill_9(tools_stack, client, service):
    """Killed mid-generation, the response completes: every token once (its usage is the
    limit), events numbered without a gap, and a stream reattached after the kill from the
    last event its client saw carries on from the next one."""
    b = create(client, STORY, background=True, max_output_tokens=150)
    first = []
    with client.responses.retrieve(b.id, stream=True) as stream:
        for event in stream:
            first.append(event)
            if sum(e.type == "response.output_text.delta" for e in first) >= 10:
                break
    assert first[-1].type == "response.output_text.delta", "it ended before the kill"
    _kill(tools_stack, service)
    tools_stack.wait_healthy(timeout_s=180)
    rest = list(client.responses.retrieve(b.id, stream=True,
                                          starting_after=first[-1].sequence_number))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = wait(client, b.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 150
    assert events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text


def test_a_streamed_message_survives_a_kill_9_of_compute(tools_stack):
    """/v1/messages streamed with the anthropic SDK: compute killed after some text, the
    stream goes on (the gateway resumes it) and ends as Anthropic's does, every token once."""
    claude = anthropic.Anthropic(base_url=tools_stack.url, api_key="-", max_retries=0)
    text, killed = [], False
    with claude.messages.stream(model=MODEL, max_tokens=120, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": STORY}]) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
                if len(text) == 10 and not killed:
                    _kill(tools_stack, "compute")
                    killed = True
        final = stream.get_final_message()
    tools_stack.wait_healthy(timeout_s=180)
    assert killed and final.stop_reason == "max_tokens" and final.usage.output_tokens == 120
    assert final.content[0].text == "".join(text)


def test_a_split_reasoning_stream_survives_a_kill_9_of_compute(tools_stack, client):
    """A chat answer made to think (a regex; SmolLM2 never opens <think> itself), streamed with
    qwen3's reasoning parser: compute killed inside the reasoning, the stream goes on, the
    split stays exact (no tags, nothing twice) and the whole still matches the grammar."""
    thinking = r"<think>[a-z ]{30,60}</think>\n\n[A-Z][a-z ]{5,30}\."
    parts, killed = {"reasoning": "", "content": ""}, False
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Think, then greet me."}],
            max_tokens=200, temperature=0, stream=True,
            extra_body={"guided_regex": thinking}):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        parts["reasoning"] += delta.model_extra.get("reasoning") or ""
        parts["content"] += delta.content or ""
        if len(parts["reasoning"]) >= 6 and not killed:
            _kill(tools_stack, "compute")
            killed = True
    tools_stack.wait_healthy(timeout_s=180)
    assert killed and "<think>" not in parts["reasoning"] and "</think>" not in parts["content"]
    assert re.fullmatch(thinking, f"<think>{parts['reasoning']}</think>{parts['content']}")
