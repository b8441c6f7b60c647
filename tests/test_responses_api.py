"""OpenAI's Responses API without a server: the translation of a body into the chat path's
request (input items, tools, text.format, reasoning, include), and the output's events driven
by hand: their order, their sequence numbers, and that the events reassemble to the final
output, the same every time (tests/test_responses_e2e.py runs it through the real services)."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from pipellm.services.gateway.chat_settings import ChatSettings
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.responses_api.custom_tools import decode_input, input_prefix
from pipellm.services.gateway.responses_api.output import ResponseOutput
from pipellm.services.gateway.responses_api.request import parse_request
from pipellm.services.gateway.responses_api.run import new_object
from pipellm.services.gateway.responses_api.store import ResponseStore
from pipellm.shared import state
from pipellm.shared.redis_server import EmbeddedRedis

CHAT = ChatSettings(tool_parser="hermes", reasoning_parser="qwen3")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather",
        "parameters": WEATHER}


def parse(history=None, **body):
    return parse_request({"model": "m", **body}, "m", history, chat=CHAT)


def roles(parsed):
    return [(m.role, m.content) for m in parsed.req.messages]


def test_a_string_input_and_instructions():
    p = parse(input="hi", instructions="Be brief.")
    assert roles(p) == [("system", "Be brief."), ("user", "hi")]
    assert p.store and not p.background and p.input_items == [
        {"type": "message", "role": "user", "content": "hi"}]  # instructions stay out


def test_items_become_chat_messages():
    p = parse(input=[
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "done", "annotations": []}]}],
        tools=[TOOL])
    m = p.req.messages
    assert [x.role for x in m] == ["developer", "user", "assistant", "tool", "assistant"]
    assert m[1].content == "a\nb" and m[2].reasoning == "think"
    assert [(c.id, c.name) for c in m[2].tool_calls] == [("c1", "get_weather"),
                                                         ("c2", "get_weather")]
    assert (m[3].tool_call_id, m[3].content) == ("c1", "sunny") and m[4].content == "done"


def test_an_unfinished_assistant_message_is_continued():
    """vLLM's rule: a last assistant message with status in_progress or incomplete is a
    prefill: the answer continues it rather than starting a new turn."""
    said = {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "One, two,"}]}
    for status, continued in (("in_progress", True), ("incomplete", True),
                              ("completed", False), (None, False)):
        req = parse(input=[{"type": "message", "role": "user", "content": "count"},
                           {**said, "status": status}]).req
        assert req.options["continue_final_message"] == continued
        assert req.add_generation_prompt != continued


def test_previous_items_come_first():
    history = [{"type": "message", "role": "user", "content": "first"},
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "one", "annotations": []}]}]
    p = parse(history, input="second")
    assert roles(p) == [("user", "first"), ("assistant", "one"), ("user", "second")]
    assert p.input_items[:2] == history


def test_tools_choice_format_reasoning_and_include():
    p = parse(input="x", tools=[TOOL, {"type": "web_search_preview"}],
              tool_choice={"type": "function", "name": "get_weather"},
              reasoning={"effort": "minimal"}, include=["message.output_text.logprobs"],
              top_logprobs=3, max_output_tokens=7, temperature=0.5)
    assert [t.name for t in p.req.tools.specs] == ["get_weather"]
    assert p.req.tools.mode == "named" and "web_search_preview" in p.notes[0]
    assert p.req.logprobs and p.req.params.top_logprobs == 3
    assert p.req.params.max_tokens == 7 and p.req.params.temperature == 0.5
    kwargs = json.loads(p.req.options["chat_template_kwargs"])
    assert kwargs == {"reasoning_effort": "minimal", "enable_thinking": False}
    assert parse(input="x", text={"format": {"type": "json_object"}}).req.grammar is not None
    schema = parse(input="x", text={"format": {"type": "json_schema", "name": "w",
                                               "schema": WEATHER}}).req.grammar
    assert json.loads(schema.spec) == WEATHER
    assert parse(input="x", tools=[TOOL], tool_choice="required").req.tools.mode == "required"
    other = {**TOOL, "name": "get_time"}
    only = parse(input="x", tools=[TOOL, other], tool_choice={
        "type": "allowed_tools", "mode": "auto",
        "tools": [{"type": "function", "name": "get_time"}]}).req.tools
    assert [s.name for s in only.specs] == ["get_time"] and only.mode == "auto"
    # the chat path's fields, as vLLM's Responses API takes them
    p = parse(input="x", presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"5": 3},
              stop_token_ids=[7], include_stop_str_in_output=True,
              structured_outputs={"regex": "[a-z]+"}, cache_salt="tenant")
    params = p.req.params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.25)
    assert params.stop_token_ids == (7,) and p.req.grammar is not None
    assert p.req.options["include_stop_str_in_output"]


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "message", "role": "user",
                 "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "enable_response_messages": True}, "enable_response_messages"),
    ({"input": "x", "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": [{"type": "summary_text",
                                                               "text": None}]}]}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": [],
                 "content": [{"type": "reasoning_text", "text": 5}]}]}, "input"),
])
def test_bad_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as err:
        parse(**body)
    assert err.value.status == 400 and err.value.param == param


# --- the output: events from deltas --------------------------------------------------------


def run(deltas, **body):
    """Feed (reasoning, text) pairs; return (events, the final Response object)."""
    p = parse(input="x", **body)
    obj = new_object("resp_abc", "m", p.echo, "in_progress")
    out = ResponseOutput(p.req, obj)
    events = out.start()
    for i, (reasoning, text) in enumerate(deltas):
        events += out.feed(reasoning, text, None, last=i == len(deltas) - 1)
    events += out.finish("completed", {"input_tokens": 1, "output_tokens": 2})
    return events, obj


def test_text_only_events_in_order():
    events, obj = run([("", "Hel"), ("", "lo")])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert obj["status"] == "completed" and obj["output"][0]["content"][0]["text"] == "Hello"
    assert events[-1]["response"]["output"] == obj["output"]
    # each event holds the item as it was when sent (the SDK's stream snapshots add deltas)
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    assert added["content"] == [] and added["status"] == "in_progress"
    part = next(e for e in events if e["type"] == "response.content_part.added")["part"]
    assert part["text"] == "" and part["logprobs"] == []


def test_reasoning_then_text_then_a_call():
    deltas = [("why ", ""), ("so", ""), ("", "Sure. "),
              ("", "<tool_call>\n{\"name\": \"get_weather\", "),
              ("", "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")]
    events, obj = run(deltas, tools=[TOOL])
    kinds = [o["type"] for o in obj["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    assert obj["output"][0]["content"][0]["text"] == "why so"
    call = obj["output"][2]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta")
    assert args == call["arguments"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]  # each item done before the next is added
    order = [e["type"] for e in events if e["type"].startswith("response.output_item")]
    assert order == ["response.output_item.added", "response.output_item.done"] * 3


def test_the_same_deltas_give_the_same_events():
    deltas = [("r", ""), ("", "a <tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                          "{\"city\": \"X\"}}\n</tool_call>")]
    first, _ = run(deltas, tools=[TOOL])
    again, _ = run(deltas, tools=[TOOL])
    strip = [{k: v for k, v in e.items() if k != "response"} for e in first]
    assert strip == [{k: v for k, v in e.items() if k != "response"} for e in again]
    assert first[-1]["response"]["output"] == again[-1]["response"]["output"]


# --- the store: a real Redis -----------------------------------------------------------------


def test_the_store_keeps_caps_expires_and_deletes():
    async def main(url):
        client = aioredis.Redis.from_url(url)
        store = ResponseStore(client, ttl_s=100, max_bytes=2000, server="s1")
        obj = new_object("resp_1", "m", parse(input="x").echo, "completed")
        assert await store.save(obj, {"body": {"input": "x"}}, [{"type": "message"}])
        got = await store.load("resp_1")
        assert got["response"] == obj and got["state"] == "completed"
        assert got["input"] == [{"type": "message"}] and got["request"]["body"]["input"] == "x"
        assert 90 < await client.ttl(state.resp_key("resp_1")) <= 100
        big = dict(obj, id="resp_2", instructions="x" * 3000)
        assert not await store.save(big) and await store.load("resp_2") is None
        await store.push("resp_1", {"t": "a"}, {"end": "completed"})
        assert await store.records("resp_1", 1) == [{"end": "completed"}]
        await store.running("resp_1", True)
        assert await store.running_ids() == ["resp_1"]
        assert await store.delete("resp_1") and not await store.delete("resp_1")
        assert await store.load("resp_1") is None and await store.running_ids() == []
        assert await store.records("resp_1") == []
        await client.aclose()

    with EmbeddedRedis() as r:
        asyncio.run(main(r.url))


# --- custom (freeform) tools: Codex's apply_patch ------------------------------------------

PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
PATCH = '*** Begin Patch\n*** Update File: a.py\n-x = "1"\n+x = "2" \\ done\n*** End Patch'


def test_custom_tools_reach_the_model_as_one_string_argument():
    p = parse(input="fix it", tools=[PATCH_TOOL, TOOL],
              tool_choice={"type": "custom", "name": "apply_patch"})
    spec = next(s for s in p.req.tools.specs if s.name == "apply_patch")
    assert json.loads(spec.parameters)["properties"] == {"input": {"type": "string"}}
    assert p.req.tools.mode == "named" and p.req.tools.named == "apply_patch"
    history = [{"type": "message", "role": "user", "content": "fix it"},
               {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
                "input": PATCH},
               {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"}]
    m = parse(input=history, tools=[PATCH_TOOL]).req.messages
    (call,) = m[1].tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == (
        "call_1", "apply_patch", {"input": PATCH})
    assert (m[2].role, m[2].tool_call_id, m[2].content) == ("tool", "call_1", "Done!")


def test_input_prefixes_only_grow_to_the_input():
    """Each prefix of a call's arguments gives a prefix of its input (an escape or a
    surrogate pair cut in two waits for the rest), and the whole gives the input."""
    for text in (PATCH, "emoji \U0001F600 and \u00e9", "quote \" end"):
        for args in (json.dumps({"input": text}), json.dumps({"input": text},
                                                             ensure_ascii=False)):
            seen = [input_prefix(args[:i]) for i in range(len(args) + 1)]
            assert all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))
            assert seen[-1] == decode_input(args) == text
    assert decode_input("not json") == "not json" and input_prefix('{"other": "x"}') == ""


def test_a_custom_call_streams_its_input():
    """The call's arguments arrive as JSON in pieces; the item is a custom_tool_call whose
    input deltas join to the decoded string."""
    args = json.dumps({"input": PATCH})
    text = '<tool_call>\n{"name": "apply_patch", "arguments": ' + args + "}\n</tool_call>"
    cuts = list(range(0, len(text), 7)) + [len(text)]
    deltas = [("", text[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    events, obj = run(deltas, tools=[PATCH_TOOL])
    (item,) = [o for o in obj["output"] if o["type"] != "message"]
    assert item["type"] == "custom_tool_call" and item["input"] == PATCH
    assert item["name"] == "apply_patch" and item["status"] == "completed"
    pieces = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert pieces and "".join(pieces) == PATCH  # as the tool parser hands the arguments on
    done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert [d["input"] for d in done] == [PATCH]
    added = next(e for e in events if e["type"] == "response.output_item.added"
                 and e["item"]["type"] == "custom_tool_call")
    assert added["item"]["input"] == ""


def test_namespace_tools_are_flat_functions_named_back():
    """A namespace's functions (Codex's MCP tools) reach the model as <namespace>__<name>;
    its call comes back under its own name with its namespace, and goes back flat."""
    ns = {"type": "namespace", "name": "github", "description": "GitHub",
          "tools": [{**TOOL, "name": "search"}, {"type": "custom", "name": "skipped"}]}
    p = parse(input="find it", tools=[ns, TOOL])
    assert [s.name for s in p.req.tools.specs] == ["github__search", "get_weather"]
    call = '<tool_call>\n{"name": "github__search", "arguments": {"city": "x"}}\n</tool_call>'
    _, obj = run([("", call)], tools=[ns, TOOL])
    (item,) = [o for o in obj["output"] if o["type"] == "function_call"]
    assert (item["name"], item["namespace"]) == ("search", "github")
    back = parse(input=[{"type": "message", "role": "user", "content": "find it"}, item,
                        {"type": "function_call_output", "call_id": item["call_id"],
                         "output": "found"}], tools=[ns]).req.messages
    assert back[1].tool_calls[0].name == "github__search"
