"""Pure builders for OpenAI-shaped response bodies and SSE chunks (dicts; the gateway dumps them).

Ids are used verbatim: make them with `new_id(kind)` ("cmpl-..." / "chatcmpl-..."). Logprobs that
JSON cannot carry (-inf, nan) are clamped to -9999.0 as vLLM does.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field

SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0
_OBJECTS = {"completion": ("text_completion", "text_completion"),
            "chat": ("chat.completion", "chat.completion.chunk")}  # kind -> (response, chunk)


@dataclass
class TokenLogprob:
    """One token in a logprobs answer: its string, its logprob (None for the prompt's first
    token: nothing before it scores it) and the k most likely tokens at its place, best first."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Choice:
    """One finished choice: its text, why it ended ("stop" | "length"), and its tokens'
    logprobs when requested (with echo, the prompt's first)."""

    index: int
    text: str | None  # chat with tool calls: the content besides them, or None
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list | None = None  # chat: tool_parsers.ToolCall (id, name, arguments)
    reasoning: str | None = None  # chat with a reasoning parser (and include_reasoning)
    has_reasoning: bool = False  # the fields are there (null without reasoning) when True


@dataclass
class Usage:
    """Token counts of a request (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def new_id(kind: str, given: str | None = None) -> str:
    """A response id: "cmpl-<given>" for completions, "chatcmpl-<given>" for chat (a fresh
    hex id where the client gave none)."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + (given or uuid.uuid4().hex)


def _logprob(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else MIN_LOGPROB


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> dict:
    """The completions `logprobs` object; `text_offset` is where the first token starts in the
    text (in a stream: the length of the text sent before this chunk). Each `top_logprobs`
    entry maps the token itself and then its k alternatives to their logprobs (vLLM's shape)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [None if e.logprob is None else _logprob(e.logprob)
                               for e in entries],
            "top_logprobs": [None if e.logprob is None else {
                e.token: _logprob(e.logprob), **{t: _logprob(v) for t, v in e.top}}
                for e in entries],
            "text_offset": offsets}


def _chat_token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _logprob(logprob),
            "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """The chat `logprobs` object: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
    return {"content": [{**_chat_token(e.token, e.logprob),
                         "top_logprobs": [_chat_token(t, v) for t, v in e.top]}
                        for e in entries]}


def _choice_logprobs(choice: Choice, kind: str) -> dict | None:
    if choice.logprobs is None:
        return None
    if kind == "chat":
        return chat_logprobs(choice.logprobs)
    return completion_logprobs(choice.logprobs)


def _envelope(kind: str, chunk: bool, req_id: str, model: str, created: int,
              choices: list[dict]) -> dict:
    return {"id": req_id, "object": _OBJECTS[kind][chunk], "created": created, "model": model,
            "choices": choices}


def completion_response(req_id: str, model: str, created: int, choices: list[Choice],
                        usage: Usage) -> dict:
    """A non-streamed `/v1/completions` response ("object": "text_completion")."""
    out = _envelope("completion", False, req_id, model, created, [
        {"index": c.index, "text": c.text, "logprobs": _choice_logprobs(c, "completion"),
         "finish_reason": c.finish_reason} for c in choices])
    out["usage"] = usage.to_dict()
    return out


def chat_response(req_id: str, model: str, created: int, choices: list[Choice],
                  usage: Usage) -> dict:
    """A non-streamed `/v1/chat/completions` response ("object": "chat.completion")."""
    out = _envelope("chat", False, req_id, model, created, [
        {"index": c.index, "message": _message(c), "logprobs": _choice_logprobs(c, "chat"),
         "finish_reason": c.finish_reason} for c in choices])
    out["usage"] = usage.to_dict()
    return out


def _message(c: Choice) -> dict:
    out = {"role": "assistant", "content": c.text}
    if c.has_reasoning:  # vLLM's name and its older one
        out["reasoning"] = out["reasoning_content"] = c.reasoning or None
    if c.tool_calls:
        out["tool_calls"] = [tool_call(call) for call in c.tool_calls]
    return out


def ranked_logprobs(token_text, prompt_ids, t) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: [None (nothing scores the first token), then per prompt token
    {"<id>": {"logprob", "rank", "decoded_token"}} of the token itself and its row's k most
    likely (ranks 1..k)]. `t`: the prompt's Tokens record (None: none came)."""
    if t is None or prompt_ids is None:
        return None
    k, out = t.k, [None]
    for i, (tok, lp) in enumerate(zip(t.token_ids, t.logprobs, strict=True)):
        rank = t.ranks[i] if len(t.ranks) > i else None
        row = {str(tok): {"logprob": _logprob(lp), "rank": rank,
                          "decoded_token": token_text(tok)}}
        for j in range(k):
            alt = t.top_ids[i * k + j]
            row.setdefault(str(alt), {"logprob": _logprob(t.top_logprobs[i * k + j]),
                                      "rank": j + 1, "decoded_token": token_text(alt)})
        out.append(row)
    return out


def tool_call(call, index: int | None = None) -> dict:
    """OpenAI's tool call object (in a stream's delta, with its index)."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def completion_chunk(req_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None, logprobs_entry: dict | None, *,
                     include_usage: bool = False) -> dict:
    """One streamed completions chunk; `logprobs_entry` from `completion_logprobs` or None.
    With `include_usage` (stream_options.include_usage) the chunk carries "usage": null."""
    out = _envelope("completion", True, req_id, model, created, [
        {"index": index, "text": text, "logprobs": logprobs_entry,
         "finish_reason": finish_reason}])
    if include_usage:
        out["usage"] = None
    return out


def chat_chunk(req_id: str, model: str, created: int, index: int, delta_content: str | None,
               role: str | None, finish_reason: str | None, logprobs_entry: dict | None, *,
               include_usage: bool = False, tool_calls: list[dict] | None = None,
               reasoning: str = "") -> dict:
    """One streamed chat chunk. The first chunk of each choice should pass role="assistant"
    (and delta_content=""); None fields are left out of `delta`. `logprobs_entry` comes from
    `chat_logprobs`; `tool_calls`: the calls' deltas (a call's first: index, id, type and
    name; later ones: index and an arguments fragment). With `include_usage` the chunk
    carries "usage": null. `reasoning`: new reasoning text (as `reasoning` and
    `reasoning_content`)."""
    delta: dict = {}
    if role is not None:
        delta["role"] = role
    if reasoning:
        delta["reasoning"] = delta["reasoning_content"] = reasoning
    if delta_content is not None:
        delta["content"] = delta_content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    out = _envelope("chat", True, req_id, model, created, [
        {"index": index, "delta": delta, "logprobs": logprobs_entry,
         "finish_reason": finish_reason}])
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(kind: str, req_id: str, model: str, created: int, usage: Usage) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, only usage.
    `kind` is "completion" or "chat"."""
    out = _envelope(kind, True, req_id, model, created, [])
    out["usage"] = usage.to_dict()
    return out


def sse(obj: dict, event: str | None = None) -> bytes:
    """One server-sent event: b"data: <json>\\n\\n" (compact, UTF-8, strict JSON), after an
    `event: <type>` line where the API names its events (Anthropic's, the Responses API's)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data.encode("utf-8") + b"\n\n"
