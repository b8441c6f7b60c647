"""Turning a request's Deltas into an HTTP answer: one JSON response, or an SSE stream.

The stream's headers go out with the first delta, so an error that comes before any output
(template failure, prompt too long, a service restart) is still a plain JSON error response.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from pipellm.services.gateway import responses
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.inflight import ChoiceState, Inflight
from pipellm.services.gateway.protocol import GenerationRequest
from pipellm.services.gateway.tool_parsers import CallArgs, CallStart, Content, ToolCall
from pipellm.shared.choice import ChoiceId
from pipellm.shared.messages import Delta, Tokens


async def deltas(gw, req: GenerationRequest, inflight: Inflight):
    """Yield (choice, delta, its logprob entries) until every choice finished; raise APIError
    on an error delta. With req.discard_output (max_tokens 0) the generated token is dropped
    here: the delta keeps only what the prompt contributes."""
    choices = inflight.choices
    open_choices = len(choices)
    while open_choices:
        delta: Delta = await inflight.deltas.get()
        if delta.error is not None:
            gw.metrics.requests.labels("failed").inc()
            raise APIError(delta.error_status or 500, delta.error, param=delta.error_param)
        c = choices[ChoiceId.parse(delta.request_id).index]
        _observe(gw, inflight, c, delta)
        if req.discard_output:  # the token, its logprob and alternatives
            delta.text, delta.tokens = "", None
            delta.finish_reason = delta.finish_reason and "length"
        entries = logprob_entries(_token_id_text if req.tokens_as_ids else gw.token_text, req,
                                  delta)
        c.add(delta, entries)
        if delta.finish_reason is not None:
            open_choices -= 1
        yield c, delta, entries
    gw.metrics.requests.labels("finished").inc()
    gw.metrics.e2e.observe(time.monotonic() - inflight.start)


def _token_id_text(token_id: int) -> str:
    """A token as return_tokens_as_token_ids names it in logprobs (vLLM's)."""
    return f"token_id:{token_id}"


def logprob_entries(token_text, req: GenerationRequest, delta: Delta,
                    ) -> list[responses.TokenLogprob]:
    """The delta's logprob entries: the prompt's (when echoed with logprobs, on the first
    delta), then its generated tokens' (when asked for). `token_text(id)`: a token's string.
    The one place compute's Tokens records turn into the shape OpenAI's answers take."""
    out = []
    if req.echo and req.kind == "completion" and delta.prompt is not None \
            and delta.prompt_ids is not None:
        out.append(responses.TokenLogprob(token_text(delta.prompt_ids[0]), None))
        out += _rows(token_text, delta.prompt)
    if req.logprobs and delta.tokens is not None:
        out += _rows(token_text, delta.tokens)
    return out


def _rows(text, t: Tokens) -> list[responses.TokenLogprob]:
    """One entry per token of `t`, with its k alternatives."""
    k = t.k
    return [responses.TokenLogprob(text(tok), lp, [
        (text(t.top_ids[j]), t.top_logprobs[j]) for j in range(i * k, (i + 1) * k)])
        for i, (tok, lp) in enumerate(zip(t.token_ids, t.logprobs, strict=True))]


def _observe(gw, inflight: Inflight, c: ChoiceState, delta: Delta) -> None:
    now = time.monotonic()
    m = gw.metrics
    if not c.token_ids:
        priority = inflight.tokenize[0].priority if inflight.tokenize else 0
        m.ttft.observe(now - inflight.start)
        m.ttft_by_priority.observe(priority, now - inflight.start)
        if delta.started_at:
            queued = max(delta.started_at - inflight.arrival, 0.0)
            m.queue.observe(queued)
            m.queue_by_priority.observe(priority, queued)
    else:
        m.itl.observe(now - c.last)
    c.last = now
    m.tokens.inc(len(delta.token_ids))


def _usage(req: GenerationRequest, choices: list[ChoiceState]) -> responses.Usage:
    """Every prompt's tokens (each counted once) and every choice's."""
    firsts = choices[:: req.generated]  # each prompt's first choice
    return responses.Usage(sum(c.num_prompt for c in firsts),
                           sum(len(c.token_ids) for c in choices),
                           sum(c.cached_tokens for c in firsts))


def echo_texts(tokenizer, req: GenerationRequest) -> list[str]:
    """Each prompt as echoed before its completions: its text, or its token ids decoded; for
    chat, the last message's text where it is the assistant's ("" without echo)."""
    if not req.echo:
        return [""] * req.num_prompts
    if req.messages is not None:
        last = req.messages[-1]
        return [last.content if last.role == "assistant" else ""]
    return [p if isinstance(p, str) else tokenizer.decode(list(p), skip_special_tokens=False)
            for p in req.prompts]


def final_answer(tokenizer, req: GenerationRequest, request_id: str,
                 choices: list[ChoiceState]) -> dict:
    """The non-streamed answer of finished `choices` (all that were generated, in index
    order), prompt by prompt: with best_of, each prompt's n with the highest cumulative
    logprob, best first."""
    g, out, states = req.generated, [], []
    for b, echo in enumerate(echo_texts(tokenizer, req)):
        answered = choices[b * g : (b + 1) * g]
        if req.best_of:
            answered = sorted(answered, key=lambda c: -c.cum_logprob)[: req.n]
        states += answered
        out += [responses.Choice(b * req.n + j, echo + "".join(c.text), c.finish_reason,
                                 c.logprobs if req.logprobs else None,
                                 reasoning="".join(c.reasoning),
                                 has_reasoning=req.shows_reasoning)
                for j, c in enumerate(answered)]
    if req.tools is not None and req.tools.mode != "none":
        for choice in out:
            choice.text, choice.tool_calls = req.tools.shaper().whole(choice.text)
            choice.finish_reason = _finish(choice.finish_reason, bool(choice.tool_calls))
    build = responses.chat_response if req.kind == "chat" else responses.completion_response
    answer = build(request_id, req.model, int(time.time()), out, _usage(req, choices))
    if req.ranked_prompt_logprobs:
        text = _cached_text(tokenizer)
        for entry, c in zip(answer["choices"], states, strict=True):
            _add_ranked(answer, entry, req, text, c)
    if req.return_token_ids:
        for entry, c in zip(answer["choices"], states, strict=True):
            _add_token_ids(answer, entry, req, c.token_ids, c.prompt_ids)
    return answer


def _cached_text(tokenizer):
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return texts[token_id]
    return text


def _add_ranked(out: dict, choice: dict, req: GenerationRequest, token_text,
                c: ChoiceState) -> None:
    """vLLM's prompt_logprobs, of the choice's prompt: chat's at the top, a completion
    choice's its own."""
    ranked = responses.ranked_logprobs(token_text, c.prompt_ids, c.prompt_tokens)
    (out if req.kind == "chat" else choice)["prompt_logprobs"] = ranked


def _add_token_ids(out: dict, choice: dict, req: GenerationRequest, token_ids,
                   prompt_ids) -> None:
    """vLLM's return_token_ids: the choice's generated ids, and its prompt's (a completion
    choice's own field; chat's at the top), where known."""
    choice["token_ids"] = list(token_ids)
    if prompt_ids is not None:
        (out if req.kind == "chat" else choice)["prompt_token_ids"] = list(prompt_ids)


def collector(build) -> Callable[..., Awaitable[web.Response]]:
    """An Answer's `collect`: wait for every choice, then answer `build(tokenizer, req,
    request_id, choices)` as JSON (final_answer, or another API's builder of that shape)."""
    async def collect(gw, req: GenerationRequest, inflight: Inflight) -> web.Response:
        async for _ in deltas(gw, req, inflight):
            pass
        return web.json_response(build(gw.tokenizer, req, inflight.request_id,
                                       inflight.choices))
    return collect


collect = collector(final_answer)


async def stream(gw, request: web.Request, req: GenerationRequest,
                 inflight: Inflight) -> web.StreamResponse:
    """The SSE answer. Headers go out with the first delta; an error after that ends the
    stream with an error event (the OpenAI client raises it), never silently."""
    resp: web.StreamResponse | None = None
    created = int(time.time())
    echoes = echo_texts(gw.tokenizer, req)
    sent_chars = [0] * len(inflight.choices)
    shapers = [req.tools.shaper() for _ in range(req.n)] if req.tools is not None else None
    try:
        async for c, delta, entries in deltas(gw, req, inflight):
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
                await resp.prepare(request)
            echo = echoes[c.index // req.generated]
            if echo and not sent_chars[c.index]:  # a choice's first chunk carries the prompt
                delta.text = echo + delta.text
            lp = None
            if req.logprobs:
                lp = (responses.chat_logprobs(entries) if req.kind == "chat"
                      else responses.completion_logprobs(entries, sent_chars[c.index]))
            sent_chars[c.index] += len(delta.text)
            shaper = shapers and shapers[c.index]
            chunk = _tool_chunk(req, inflight, created, c, delta, lp, shaper) if shaper else \
                _chunk(req, inflight, created, c, delta, lp)
            if chunk is None:
                continue
            if req.ranked_prompt_logprobs and delta.prompt is not None:
                _add_ranked(chunk, chunk["choices"][0], req, gw.token_text, c)
            if req.return_token_ids:
                first = c.prompt_ids is not None and not c.sent_prompt_ids
                _add_token_ids(chunk, chunk["choices"][0], req, delta.token_ids,
                               c.prompt_ids if first else None)
                c.sent_prompt_ids = c.sent_prompt_ids or first
            if req.continuous_usage:  # vLLM's: this choice's tokens so far
                chunk["usage"] = responses.Usage(c.num_prompt, len(c.token_ids),
                                                 c.cached_tokens).to_dict()
            await resp.write(responses.sse(chunk))
    except APIError as e:
        if resp is None:
            raise
        await resp.write(responses.sse(e.body()))
    else:
        if req.include_usage:
            await resp.write(responses.sse(responses.usage_chunk(
                req.kind, inflight.request_id, req.model, created,
                _usage(req, inflight.choices))))
    await resp.write(responses.SSE_DONE)
    await resp.write_eof()
    return resp


@dataclass(frozen=True)
class Answer:
    """How an API answers a generation request once it is sent: `collect(gw, req, inflight)`
    waits for every choice and returns one JSON response; `stream(gw, request, req,
    inflight)` writes its SSE answer. Both read the request's Deltas through `deltas`."""

    collect: Callable[..., Awaitable[web.StreamResponse]]
    stream: Callable[..., Awaitable[web.StreamResponse]]


OPENAI = Answer(collect, stream)  # /v1/completions and /v1/chat/completions


def _finish(reason: str | None, called: bool) -> str | None:
    """A choice that made tool calls and ended by itself ends with "tool_calls"."""
    return "tool_calls" if called and reason == "stop" else reason


def _tool_chunk(req: GenerationRequest, inflight: Inflight, created: int, c: ChoiceState,
                delta: Delta, lp: dict | None, shaper) -> dict | None:
    """The chat chunk of a delta of a choice with tools: its text through the choice's
    ToolShaper, as content and tool-call deltas; None when there is nothing to send yet."""
    events = shaper.feed(delta.text)  # the content: reasoning is never parsed for calls
    if delta.finish_reason is not None:
        events += shaper.finish()
    reasoning = delta.reasoning if req.shows_reasoning else ""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = []
    for e in events:
        if isinstance(e, CallStart):
            calls.append(responses.tool_call(ToolCall(e.id, e.name, ""), e.index))
        elif isinstance(e, CallArgs):
            calls.append({"index": e.index, "function": {"arguments": e.fragment}})
    finish = _finish(delta.finish_reason, shaper.calls > 0)
    if not (content or calls or finish or lp or reasoning or not c.sent_role):
        return None
    role = None if c.sent_role else "assistant"
    c.sent_role = True
    return responses.chat_chunk(inflight.request_id, req.model, created, c.index,
                                content if content or role else None, role, finish, lp,
                                include_usage=req.include_usage, tool_calls=calls,
                                reasoning=reasoning)


def _chunk(req: GenerationRequest, inflight: Inflight, created: int, c: ChoiceState,
           delta: Delta, lp: dict | None) -> dict:
    if req.kind == "chat":
        role = None if c.sent_role else "assistant"
        c.sent_role = True
        reasoning = delta.reasoning if req.shows_reasoning else ""
        content = delta.text if delta.text or not reasoning or role else None
        return responses.chat_chunk(inflight.request_id, req.model, created, c.index,
                                    content, role, delta.finish_reason, lp,
                                    include_usage=req.include_usage, reasoning=reasoning)
    return responses.completion_chunk(inflight.request_id, req.model, created, c.index,
                                      delta.text, delta.finish_reason, lp,
                                      include_usage=req.include_usage)
