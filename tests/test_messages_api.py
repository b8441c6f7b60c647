"""Anthropic's Messages API without a server: the translation of a body into the chat path's
request (each block kind, tools, tool_choice, thinking), the whole message, the SSE event
sequence driven by hand-made Deltas, and the error shape under /v1/messages
(tests/test_tools_e2e.py runs the API through the real services with the anthropic SDK)."""

from __future__ import annotations

import asyncio
import json
from array import array

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pipellm.services.detokenizer.stop import StopMatcher
from pipellm.services.gateway.access import api_key_middleware
from pipellm.services.gateway.app import ERROR_SHAPES
from pipellm.services.gateway.chat_settings import ChatSettings
from pipellm.services.gateway.errors import APIError, errors_as_json
from pipellm.services.gateway.inflight import ChoiceState, Inflight
from pipellm.services.gateway.messages_api import events as event_stream
from pipellm.services.gateway.messages_api import message
from pipellm.services.gateway.messages_api.events import MessageEvents, sse
from pipellm.services.gateway.messages_api.request import parse_request
from pipellm.services.gateway.metrics import Metrics
from pipellm.shared.messages import Delta, Tokens

CHAT = ChatSettings(tool_parser="hermes", reasoning_parser="qwen3")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER}


def parse(chat=CHAT, **body):
    req, notes = parse_request({"model": "m", "max_tokens": 50, **body}, "m", chat=chat)
    return req, notes


def msgs(*messages, **body):
    return parse(messages=list(messages), **body)[0].messages


def test_system_and_text_blocks():
    m = msgs({"role": "user", "content": [{"type": "text", "text": "a",
                                            "cache_control": {"type": "ephemeral"}},
                                           {"type": "text", "text": "b"}]},
             system=[{"type": "text", "text": "S1", "cache_control": {"type": "ephemeral"}},
                     {"type": "text", "text": "S2"}])
    assert [(x.role, x.content) for x in m] == [("system", "S1\nS2"), ("user", "a\nb")]
    assert msgs({"role": "user", "content": "hi"}, system="S")[0].content == "S"
    # system messages in `messages` join the system prompt (vLLM's merge); Claude Code's
    # billing header, a per-request hash, is left out so that the prefix cache hits
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=ab12;"}
    m = msgs({"role": "system", "content": [billing, {"type": "text", "text": "S3"}]},
             {"role": "user", "content": "hi"}, system=[billing, {"type": "text", "text": "S1"}])
    assert [(x.role, x.content) for x in m] == [("system", "S1\nS3"), ("user", "hi")]
    assert [x.role for x in msgs({"role": "user", "content": "hi"}, system=[billing])] == [
        "system", "user"]  # a system prompt given stays, even empty


def test_tool_search_blocks():
    """Anthropic's tool search (as Claude Code sends it with many MCP tools): a tool_result's
    tool_reference names the tool found; system messages' tool_addition / tool_removal
    change the tools, as vLLM resolves them; defer_loading is accepted (every tool is shown)."""
    search = {"name": "tool_search", "input_schema": {"type": "object"}}
    deferred = {**TOOL, "defer_loading": True}
    req, _ = parse(tools=[search, deferred], messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "tool_search", "input": {"q": "weather"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "found:"},
                {"type": "tool_reference", "tool_name": "get_weather"}]},
            {"type": "tool_reference", "tool_name": "get_weather"}]}])
    assert [s.name for s in req.tools.specs] == ["tool_search", "get_weather"]
    assert req.messages[2].content == "found:\nTool loaded: get_weather"
    added = {"name": "now", "input_schema": {"type": "object"}}
    changes = [{"type": "tool_removal", "tool": {"type": "tool_reference",
                                                 "name": "tool_search"}},
               {"type": "tool_addition", "tool": {"type": "tool_definition",
                                                  "definition": added}},
               {"type": "text", "text": "S"}]
    req, _ = parse(tools=[search, deferred], messages=[
        {"role": "system", "content": changes}, {"role": "user", "content": "hi"}])
    assert [s.name for s in req.tools.specs] == ["get_weather", "now"]
    assert req.messages[0].content == "S"
    for change in ({"type": "tool_reference", "name": "nope"},
                   {"type": "tool_definition", "definition": {"no": "name"}}):
        with pytest.raises(APIError) as e:
            parse(tools=[search], messages=[{"role": "system", "content": [
                {"type": "tool_addition", "tool": change}]}, {"role": "user", "content": "x"}])
        assert e.value.param == "messages[0].content[0].tool"


def test_tool_use_and_tool_result_blocks():
    m = msgs({"role": "user", "content": "weather?"},
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "need a tool", "signature": "x"},
                 {"type": "redacted_thinking", "data": "opaque"},
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                  "input": {"city": "Paris"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                  "content": [{"type": "text", "text": "21C"}]},
                 {"type": "text", "text": "and now?"}]},
             tools=[TOOL])
    assert [x.role for x in m] == ["user", "assistant", "tool", "user"]
    a = m[1]
    assert a.content == "Let me look." and a.reasoning == "need a tool"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in a.tool_calls] == [
        ("toolu_1", "get_weather", {"city": "Paris"})]
    assert (m[2].tool_call_id, m[2].content) == ("toolu_1", "21C")
    assert m[3].content == "and now?"


def test_a_call_alone_and_a_string_tool_result():
    m = msgs({"role": "user", "content": "w"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name":
                                                "get_weather", "input": {"city": "X"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                           "content": "sunny", "is_error": True}]},
             tools=[TOOL])
    assert m[1].content == "" and len(m[1].tool_calls) == 1
    assert [(x.role, x.content) for x in m[2:]] == [("tool", "sunny")]


def test_a_last_assistant_message_is_continued():
    req, _ = parse(messages=[{"role": "user", "content": "Count"},
                             {"role": "assistant", "content": "1, 2,"}])
    assert req.options["continue_final_message"] and not req.add_generation_prompt
    req, _ = parse(messages=[{"role": "user", "content": "Count"}])
    assert not req.options["continue_final_message"] and req.add_generation_prompt


@pytest.mark.parametrize("block, says", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}},
     "images are not supported"),
    ({"type": "document", "source": {}}, "documents are not supported"),
    ({"type": "video"}, "not supported"),
    ({"text": "no type"}, "content block"),
])
def test_unserved_blocks_are_400s(block, says):
    with pytest.raises(APIError) as e:
        msgs({"role": "user", "content": [block]})
    assert e.value.status == 400 and says in e.value.message


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"model": "other"}, "model"),
])
def test_bad_bodies_are_400s(body, param):
    full = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError) as e:
        parse_request({**full, **body}, "m", chat=CHAT)
    assert e.value.param == param and e.value.status in (400, 404)


@pytest.mark.parametrize("messages, says", [([], "messages must not be empty"),
                                             ("hi", "messages must be an array, got string")])
def test_messages_must_be_a_non_empty_array(messages, says):
    with pytest.raises(APIError) as e:
        parse_request({"model": "m", "max_tokens": 5, "messages": messages}, "m", chat=CHAT)
    assert e.value.message == says


def test_max_tokens_is_required_except_to_count():
    body = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError):
        parse_request(body, "m")
    req, _ = parse_request(body, "m", count_only=True)
    assert req.messages[0].content == "x"


@pytest.mark.parametrize("choice, mode, named, parallel", [
    ({"type": "auto"}, "auto", "", True),
    ({"type": "any"}, "required", "", True),
    ({"type": "none"}, "none", "", True),
    ({"type": "tool", "name": "get_weather"}, "named", "get_weather", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", "", False),
    (None, "auto", "", True),
])
def test_tool_choice(choice, mode, named, parallel):
    req, _ = parse(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                   tool_choice=choice)
    assert (req.tools.mode, req.tools.named, req.tools.parallel) == (mode, named, parallel)
    assert [s.name for s in req.tools.specs] == ["get_weather"]
    assert json.loads(req.tools.specs[0].parameters) == WEATHER
    assert (req.grammar is not None) == (mode in ("required", "named"))


def test_server_tools_are_skipped_with_a_note():
    req, notes = parse(messages=[{"role": "user", "content": "x"}], tools=[
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"},
        {**TOOL, "cache_control": {"type": "ephemeral"}, "type": "custom"}])
    assert [s.name for s in req.tools.specs] == ["get_weather"]
    assert len(notes) == 2 and "web_search_20250305" in notes[0]
    req, _ = parse(messages=[{"role": "user", "content": "x"}], tool_choice={"type": "auto"},
                   tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert req.tools is None


def test_sampling_fields_stop_and_metadata():
    req, _ = parse(messages=[{"role": "user", "content": "x"}], temperature=0.3, top_p=0.9,
                   top_k=7, stop_sequences=["END", "\n\n"], stream=True,
                   metadata={"user_id": "u-1"}, service_tier="auto", container=None,
                   mcp_servers=[], something_new=1)
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.3, 0.9, 7, 50)
    assert req.stop == ("END", "\n\n") and req.stream and req.user == "u-1"
    assert not req.max_tokens_given  # a ceiling: lowered to the context's room
    assert "something_new" in req.ignored
    with pytest.raises(APIError):
        parse_request({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                       "something_new": 1}, "m", strict=True)


@pytest.mark.parametrize("thinking, chat, kwargs, budget", [
    ({"type": "enabled", "budget_tokens": 1024}, CHAT, {"enable_thinking": True}, 1024),
    ({"type": "enabled", "budget_tokens": 1024}, ChatSettings(), {"enable_thinking": True}, 0),
    ({"type": "adaptive"}, CHAT, {"enable_thinking": True}, 0),
    ({"type": "disabled"}, CHAT, {"enable_thinking": False}, 0),
    (None, CHAT, None, 0),
])
def test_thinking(thinking, chat, kwargs, budget):
    req, _ = parse(chat, messages=[{"role": "user", "content": "x"}], thinking=thinking)
    got = req.options["chat_template_kwargs"]
    assert (json.loads(got) if got else None) == kwargs
    assert req.options["thinking_token_budget"] == budget


# --- answers ---------------------------------------------------------------------------------

def delta(text="", reasoning="", finish=None, n=1, stop=None, cached=0):
    tokens = Tokens("r", 0, array("i", range(n)), array("f", [0.0] * n), finish_reason=finish)
    return Delta("chatcmpl-abc", text, tokens, finish, num_prompt=20, num_output=0,
                 reasoning=reasoning, stop_string=stop, cached_tokens=cached)


def run(req, deltas):
    """(events, the choice) after feeding `deltas` as the stream does."""
    c, ev, out = ChoiceState(0), MessageEvents(req, "chatcmpl-abc"), []
    for d in deltas:
        c.add(d, [])
        out += ev.feed(c, d)
    return out, c


def kinds(events) -> list[str]:
    names = []
    for kind, data in events:
        if kind == "content_block_start":
            kind += ":" + data["content_block"]["type"]
        elif kind == "content_block_delta":
            kind = data["delta"]["type"]
        names.append(kind)
    return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]  # runs as one


def snapshot(events) -> dict:
    """The message the events assemble to, as the SDK's stream helper accumulates it."""
    msg, bufs = None, {}
    for kind, data in events:
        if kind == "message_start":
            msg = json.loads(json.dumps(data["message"]))
        elif kind == "content_block_start":
            assert data["index"] == len(msg["content"])
            msg["content"].append(dict(data["content_block"]))
        elif kind == "content_block_delta":
            block, d = msg["content"][data["index"]], data["delta"]
            if d["type"] == "input_json_delta":
                bufs[data["index"]] = bufs.get(data["index"], "") + d["partial_json"]
                block["input"] = json.loads(bufs[data["index"]] or "{}") if \
                    _complete(bufs[data["index"]]) else block["input"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking",
                       "signature_delta": "signature"}[d["type"]]
                block[key] = (block[key] + d[key]) if key != "signature" else d[key]
        elif kind == "message_delta":
            msg.update(data["delta"])
            msg["usage"].update(data["usage"])
    return msg


def _complete(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def check_order(events) -> None:
    """message_start first, message_stop last; blocks numbered in order, one open at once."""
    assert events[0][0] == "message_start" and events[1][0] == "ping"
    assert events[-1][0] == "message_stop" and events[-2][0] == "message_delta"
    open_index, last = None, -1
    for kind, data in events:
        if kind == "content_block_start":
            assert open_index is None and data["index"] == last + 1
            open_index = last = data["index"]
        elif kind == "content_block_delta":
            assert data["index"] == open_index
        elif kind == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif kind == "message_delta":
            assert open_index is None


def test_text_only():
    req, _ = parse(messages=[{"role": "user", "content": "hi"}])
    ds = [delta("Hel", cached=16), delta("lo", n=2), delta("!", finish="stop")]
    events, c = run(req, ds)
    check_order(events)
    assert kinds(events) == ["message_start", "ping", "content_block_start:text", "text_delta",
                             "content_block_stop", "message_delta", "message_stop"]
    whole = message(None, req, "chatcmpl-abc", [c])
    assert snapshot(events) == whole
    assert whole["id"] == "msg_abc" and whole["content"] == [{"type": "text", "text": "Hello!"}]
    assert whole["stop_reason"] == "end_turn" and whole["stop_sequence"] is None
    assert whole["usage"] == {"input_tokens": 4, "output_tokens": 4,
                              "cache_read_input_tokens": 16, "cache_creation_input_tokens": 0}
    assert sse(events[-1]) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def test_thinking_then_text():
    req, _ = parse(messages=[{"role": "user", "content": "hi"}])
    ds = [delta(reasoning="let me "), delta(reasoning="think"), delta("\n\nHi", "", None),
          delta(" there", finish="length")]
    events, c = run(req, ds)
    check_order(events)
    assert kinds(events) == [
        "message_start", "ping", "content_block_start:thinking", "thinking_delta",
        "signature_delta", "content_block_stop", "content_block_start:text", "text_delta",
        "content_block_stop", "message_delta", "message_stop"]
    whole = message(None, req, "chatcmpl-abc", [c])
    assert whole["content"] == [
        {"type": "thinking", "thinking": "let me think", "signature": ""},
        {"type": "text", "text": "\n\nHi there"}]
    assert whole["stop_reason"] == "max_tokens" and snapshot(events) == whole


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("cut", [1, 7, 1000])
def test_thinking_text_and_a_tool_use(cut):
    req, _ = parse(messages=[{"role": "user", "content": "w"}], tools=[TOOL])
    text = "Checking." + CALL
    pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
    ds = [delta(reasoning="hmm")] + [delta(p) for p in pieces[:-1]] + \
        [delta(pieces[-1], finish="stop")]
    events, c = run(req, ds)
    check_order(events)
    assert kinds(events) == [
        "message_start", "ping", "content_block_start:thinking", "thinking_delta",
        "signature_delta", "content_block_stop", "content_block_start:text", "text_delta",
        "content_block_stop", "content_block_start:tool_use", "input_json_delta",
        "content_block_stop", "message_delta", "message_stop"]
    pieces = [d["delta"]["partial_json"] for k, d in events
              if k == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert json.loads("".join(pieces)) == {"city": "Paris"}
    whole = message(None, req, "chatcmpl-abc", [c])
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    use = whole["content"][2]
    assert use["id"].startswith("toolu_") and use["input"] == {"city": "Paris"}
    assert whole["stop_reason"] == "tool_use"
    got = snapshot(events)
    got["content"][2]["id"] = use["id"]  # each shaper names its calls
    assert got == whole


def test_a_named_tool_streams_its_input_in_pieces():
    req, _ = parse(messages=[{"role": "user", "content": "w"}], tools=[TOOL],
                   tool_choice={"type": "tool", "name": "get_weather"})
    args = '{"city": "Oslo"}'
    ds = [delta(args[i : i + 3]) for i in range(0, len(args), 3)]
    ds[-1].finish_reason = "stop"
    events, c = run(req, ds)
    check_order(events)
    pieces = [d["delta"]["partial_json"] for k, d in events if k == "content_block_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Oslo"}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    whole = message(None, req, "chatcmpl-abc", [c])
    assert [b["input"] for b in whole["content"]] == [{"city": "Oslo"}]


def test_stop_sequence_and_an_empty_answer():
    req, _ = parse(messages=[{"role": "user", "content": "x"}], stop_sequences=["END"])
    events, c = run(req, [delta("a b", finish="stop", stop="END")])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert message(None, req, "chatcmpl-abc", [c])["stop_sequence"] == "END"
    events, c = run(req, [delta("", finish="stop")])
    check_order(events)
    assert kinds(events) == ["message_start", "ping", "message_delta", "message_stop"]
    # Anthropic's (and vLLM's) empty answer: one empty text block
    assert message(None, req, "chatcmpl-abc", [c])["content"] == [{"type": "text", "text": ""}]


# --- errors ----------------------------------------------------------------------------------

def test_errors_under_v1_messages_take_anthropics_shape():
    asyncio.run(_errors())


async def _errors():
    async def fail(request):
        raise APIError(int(request.query["status"]), "nope")

    app = web.Application(middlewares=[errors_as_json(ERROR_SHAPES), api_key_middleware("k")])
    app.router.add_post("/v1/messages", fail)
    app.router.add_post("/v1/chat/completions", fail)
    async with TestClient(TestServer(app)) as client:
        r = await client.post("/v1/messages", headers={"x-api-key": "bad"})
        assert r.status == 401 and await r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": (await r.json())["error"]["message"]}}
        for status, kind in [(400, "invalid_request_error"), (404, "not_found_error"),
                             (413, "request_too_large"), (429, "rate_limit_error"),
                             (500, "api_error"), (503, "overloaded_error")]:
            r = await client.post(f"/v1/messages?status={status}", headers={"x-api-key": "k"})
            assert r.status == status
            assert await r.json() == {"type": "error", "error": {"type": kind,
                                                                 "message": "nope"}}
        r = await client.post("/v1/chat/completions?status=400",
                              headers={"Authorization": "Bearer k"})
        assert (await r.json())["error"]["type"] == "invalid_request_error"
        assert "param" in (await r.json())["error"]  # OpenAI's shape elsewhere


def test_the_matched_stop_string_is_known():
    """What the detokenizer puts in Delta.stop_string (the stop_sequence answered)."""
    m = StopMatcher(["c", "bcd", "zz"])
    assert m.feed("ab") == ("a", False) and m.stop is None
    assert m.feed("cx") == ("b", True) and m.stop == "c"
    m = StopMatcher(["END"], include_stop_str_in_output=True)
    assert m.feed("x EN") == ("x ", False)
    assert m.feed("D y") == ("END", True) and m.stop == "END"


def test_a_ping_goes_out_after_silence(monkeypatch):
    """A stream whose model is silent (a long prefill of a later choice, a slow step) still
    sends a ping every PING_S, and none while events flow."""
    monkeypatch.setattr(event_stream, "PING_S", 0.05)

    class Resp:
        def __init__(self):
            self.out = []

        async def write(self, data: bytes) -> None:
            self.out.append(data)

    async def go() -> list[bytes]:
        resp = Resp()
        writer = event_stream._Writer(resp)
        pinger = asyncio.create_task(writer.keepalive())
        for _ in range(4):  # busy: no pings
            await writer.send([("ping_not", {"type": "x"})])
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.18)  # silent: about three
        pinger.cancel()
        return resp.out

    out = asyncio.run(go())
    assert out[:4] == [b'event: ping_not\ndata: {"type":"x"}\n\n'] * 4
    assert 2 <= len(out[4:]) <= 4 and set(out[4:]) == {b'event: ping\ndata: {"type":"ping"}\n\n'}


class _Gateway:
    """What `stream` and `deltas` read of a Gateway."""

    def __init__(self):
        self.metrics, self.tokenizer = Metrics("m"), None

    def token_text(self, token_id: int) -> str:
        return str(token_id)


def _serve_stream(sent: list[Delta]) -> tuple[int, str]:
    """(status, body) of a /v1/messages stream whose request gets the deltas `sent`."""
    req, _ = parse(messages=[{"role": "user", "content": "x"}], stream=True)

    async def handler(request):
        inflight = Inflight("chatcmpl-abc", 1)
        for d in sent:
            inflight.deltas.put_nowait(d)
        return await event_stream.stream(_Gateway(), request, req, inflight)

    async def go():
        app = web.Application(middlewares=[errors_as_json(ERROR_SHAPES)])
        app.router.add_post("/v1/messages", handler)
        async with TestClient(TestServer(app)) as client:
            r = await client.post("/v1/messages")
            return r.status, await r.text()

    return asyncio.run(go())


def test_an_error_after_the_stream_started_is_an_error_event():
    fail = Delta("chatcmpl-abc", error="compute restarted too often", error_status=503)
    status, body = _serve_stream([delta("Hi"), fail])
    assert status == 200
    chunks = body.strip().split("\n\n")
    assert chunks[0].startswith("event: message_start") and len(chunks) == 5  # start, ping,
    # block start, text delta, error
    assert chunks[-1] == 'event: error\ndata: {"type":"error","error":{"type":' \
        '"overloaded_error","message":"compute restarted too often"}}'
    status, body = _serve_stream([fail])  # before any output: a plain JSON error
    assert status == 503 and json.loads(body) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "compute restarted too often"}}


def test_chat_extensions_pass_through_and_output_config():
    req, _ = parse(messages=[{"role": "user", "content": "x"}], seed=7, min_p=0.1,
                   guided_regex="[a-z]+", chat_template_kwargs={"a": 1, "enable_thinking": True},
                   thinking={"type": "disabled"})
    assert (req.params.seed, req.params.min_p) == (7, 0.1) and req.grammar is not None
    assert json.loads(req.options["chat_template_kwargs"]) == {"a": 1, "enable_thinking": False}
    req, _ = parse(messages=[{"role": "user", "content": "x"}], output_config={
        "effort": "low", "format": {"type": "json_schema", "schema": WEATHER}})
    assert req.grammar is not None and json.loads(req.grammar.spec) == WEATHER
    assert json.loads(req.options["chat_template_kwargs"]) == {"reasoning_effort": "low"}
    req, _ = parse(messages=[{"role": "user", "content": "x"}], output_config={"effort": "max"},
                   thinking={"type": "disabled"})
    assert json.loads(req.options["chat_template_kwargs"]) == {"reasoning_effort": "max",
                                                                "enable_thinking": False}
    with pytest.raises(APIError) as e:
        parse(messages=[{"role": "user", "content": "x"}],
              output_config={"format": {"type": "regex"}})
    assert e.value.param == "output_config.format"
