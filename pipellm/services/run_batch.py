"""`pipellm run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file through the
engine in-process, without the services (vLLM's `run_batch`).

Each input line is `{"custom_id", "method": "POST", "url": "/v1/completions",
"/v1/chat/completions", "/v1/messages" (Anthropic's) or "/v1/responses" (not stored: no
previous_response_id or background), "body": {...}}` (on a pooling model: "/v1/embeddings",
"/score", "/v1/score", "/rerank", "/v1/rerank" or "/v2/rerank": run_batch_pooling.py); each
output line, in input order, is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`. A line
that cannot be served gets its 4xx and error body there; the others run, all at once through
the engine's scheduler. The parts are the server's: the gateway's request parsing, choice
bookkeeping and response shapes, the tokenizer's prompt preparation, compute's step message and
the detokenizer itself; so an answer is what the server gives for the same request and seed.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pipellm.services.compute.compute_core import ComputeCore, choice_ids
from pipellm.services.detokenizer.service import Detokenizer
from pipellm.services.gateway import messages_api, protocol, responses
from pipellm.services.gateway.chat_settings import NO_CHAT, ChatSettings
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.inflight import ChoiceState
from pipellm.services.gateway.messages_api.request import parse_request as parse_message
from pipellm.services.gateway.responses_api.request import parse_request as parse_response
from pipellm.services.gateway.responses_api.run import whole_response
from pipellm.services.gateway.service import embedding_settings
from pipellm.services.gateway.stream import final_answer, logprob_entries
from pipellm.services.run_batch_pooling import PooledLine, PoolingLines, is_pooling_url
from pipellm.services.tokenizer.service import PromptError, Tokenizer
from pipellm.shared.config import SchedulingPolicyName, ServiceConfig
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.messages import Delta, StepOutput
from pipellm.shared.sampling import InvalidParams
from pipellm.shared.tokenizer import decode

Answer = Callable[[list[ChoiceState]], dict]  # a finished item's choices -> its body


def _openai(parse):
    def one(body, model, defaults, chat, tok) -> tuple[protocol.GenerationRequest, Answer]:
        extra = {"chat": chat} if parse is protocol.parse_chat else {}
        req = parse(body, model, defaults=defaults, **extra)
        return req, lambda choices: final_answer(tok, req, responses.new_id(req.kind), choices)
    return one


def _messages(body, model, defaults, chat, tok) -> tuple[protocol.GenerationRequest, Answer]:
    req, _ = parse_message(body, model, defaults=defaults, chat=chat)
    return req, lambda choices: messages_api.message(tok, req, responses.new_id("chat"),
                                                     choices)


def _responses(body, model, defaults, chat, tok) -> tuple[protocol.GenerationRequest, Answer]:
    if isinstance(body, dict) and (body.get("previous_response_id") or body.get("background")):
        raise APIError(400, "run-batch stores no responses: previous_response_id and "
                       "background are not supported", param="previous_response_id")
    parsed = parse_response(body, model, defaults=defaults, chat=chat)
    rid = f"resp_{uuid.uuid4().hex}"
    return parsed.req, lambda choices: whole_response(tok, parsed, rid, choices)


URLS = {"/v1/completions": _openai(protocol.parse_completion),
        "/v1/chat/completions": _openai(protocol.parse_chat),
        "/v1/messages": _messages, "/v1/responses": _responses}


@dataclass
class Item:
    """One input line: its request (None if it failed to parse) and its choices."""

    custom_id: str | None
    request_id: str
    req: protocol.GenerationRequest | None = None
    answer: Answer | None = None  # its body, once its choices finished
    error: APIError | None = None
    choices: dict[str, ChoiceState] = field(default_factory=dict)  # choice id, in index order
    pooled: PooledLine | None = None  # a pooling API's line
    body: dict | None = None  # a pooled line's answer, once run


class BatchRunner:
    """The server's pipeline in one process: compute's own core (ComputeCore) admits the
    requests and turns each engine step into the StepOutput compute would send, the
    detokenizer's own logic turns it into Deltas (text, stop strings, the held-back remainder
    at a finish), and each choice takes them in as the gateway does."""

    def __init__(self, engine, tokenizer: Tokenizer, model_name: str,
                 defaults: GenerationDefaults | None = None,
                 chat: ChatSettings = NO_CHAT, max_text_bytes: int = 0):
        """`defaults`: the model's sampling defaults, applied as the gateway applies them;
        `chat`: the chat flags, as the gateway's; `max_text_bytes`: a pooling line's text limit
        (the server's --max-prompt-bytes; 0: its default for the context)."""
        self.core, self.tokenizer, self.model_name = ComputeCore(engine), tokenizer, model_name
        settings = embedding_settings(engine.config)
        self.pooling = PoolingLines(engine, tokenizer, model_name, settings, max_text_bytes or
                                    ServiceConfig().prompt_bytes_limit(tokenizer.max_model_len))
        self.defaults = defaults or GenerationDefaults()
        self.chat = chat
        self.priorities = engine.config.scheduler.scheduling_policy != SchedulingPolicyName.FCFS
        self.detokenizer = Detokenizer(tokenizer.tok, ttl_s=0)
        self.live: dict[str, tuple[Item, ChoiceState]] = {}  # choice id -> its item and state

    def parse(self, line: str) -> Item:
        """An input line as an Item; an unusable one carries its error."""
        item = Item(None, f"batch_req_{uuid.uuid4().hex}")
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise APIError(400, "each line must be a JSON object")
            item.custom_id = obj.get("custom_id")
            url, method = obj.get("url"), obj.get("method", "POST")
            if is_pooling_url(url) and method == "POST":
                item.pooled = self.pooling.parse(url, obj.get("body"))
                return item
            parse = URLS.get(url)
            if parse is None or method != "POST":
                raise APIError(400, f"url must be POST {' or '.join(URLS)} (a generation "
                               "model), or /v1/embeddings, /v1/score or /v1/rerank (a pooling "
                               "model)", param="url")
            if self.pooling.settings.pooling:
                raise APIError(400, f"The model does not support {url}: it is a pooling model "
                               "(--runner pooling): use /v1/embeddings, /v1/score or "
                               "/v1/rerank", param="model")
            item.req, item.answer = parse(obj.get("body"), self.model_name, self.defaults,
                                          self.chat, self.tokenizer.tok)
            if item.req.params.prompt_logprobs is not None:
                raise APIError(400, "prompt logprobs (echo with logprobs) are not supported by "
                               "run-batch", param="echo")
            priority = item.req.options.get("priority", 0)
            if priority and not self.priorities:  # the gateway's 400 (app.py), vLLM's message
                raise APIError(400, f"Got priority {priority} but Priority scheduling is not "
                               "enabled.", param="priority")
        except json.JSONDecodeError as exc:
            item.error = APIError(400, f"line is not JSON: {exc}")
        except APIError as exc:
            item.error = exc
        return item

    def submit(self, item: Item) -> None:
        """Tokenize `item` and queue its choices in compute (or record why not); a pooled line
        runs in `run_pooled`."""
        if item.error is not None or item.pooled is not None:
            return
        tokenize = item.req.tokenize_requests(item.request_id, "", secrets.randbits(62), 0.0)
        try:  # every prompt's choices, in their index order
            requests = [g for one in tokenize for g in self.tokenizer.prepare(one)]
        except (PromptError, InvalidParams) as exc:
            item.error = APIError(400, str(exc), param=getattr(exc, "param", None))
            return
        for g in requests:
            for choice in choice_ids(g):
                item.choices[choice] = ChoiceState(len(item.choices))
                self.live[choice] = (item, item.choices[choice])
            self.core.submit(g)

    def run(self, on_step) -> None:
        """Run compute until every choice finished; `on_step(tokens)` after each step."""
        while self.live:
            notices = self.core.notices()
            if notices is not None:
                self._handle(notices)
            if self.core.has_work():
                out = self.core.step()
                self._handle(out)
                on_step(sum(len(t.token_ids) for t in out.outputs))
            elif notices is None:
                time.sleep(0.001)  # a grammar compiles
            if not self.core.has_work() and not self.core.compiling() and self.live:
                raise RuntimeError(f"compute is idle with {len(self.live)} choices unanswered")

    def run_pooled(self, items: list[Item]) -> None:
        """Run every pooled line of `items` (together), recording its body or error."""
        pooled = [i for i in items if i.pooled is not None and i.error is None]
        for item, answer in zip(pooled, self.pooling.run([i.pooled for i in pooled]),
                                strict=True):
            if isinstance(answer, APIError):
                item.error = answer
            else:
                item.body = answer

    def _handle(self, out: StepOutput) -> None:
        res = self.detokenizer.handle(out)
        for stop in res.stops:  # a stop string matched: compute stops that choice
            self.core.abort(stop.request_id)
        for deltas in res.deltas.values():
            for delta in deltas:
                if delta.request_id in self.live:
                    self._take(delta)

    def _take(self, delta: Delta) -> None:
        item, choice = self.live[delta.request_id]
        if delta.error is not None:  # refused in compute (a grammar that does not compile)
            item.error = APIError(delta.error_status or 500, delta.error,
                                  param=delta.error_param)
            for rid in item.choices:
                self.core.abort(rid)
                self.live.pop(rid, None)
            return
        choice.add(delta, logprob_entries(self._token_text, item.req, delta))
        if delta.finish_reason is not None:
            del self.live[delta.request_id]

    def _token_text(self, token_id: int) -> str:
        return decode(self.tokenizer.tok, [token_id], skip_special_tokens=False)

    def output(self, item: Item) -> dict:
        """The output line of a finished item."""
        if item.error is not None:
            status, body = item.error.status, item.error.body()
        else:
            status, body = 200, self._body(item)
        return {"id": item.request_id, "custom_id": item.custom_id,
                "response": {"status_code": status, "request_id": item.request_id,
                             "body": body}, "error": None}

    def _body(self, item: Item) -> dict:
        """The answer the gateway gives (the API's own builder of it)."""
        if item.body is not None:
            return item.body
        return item.answer(list(item.choices.values()))


def run_batch(engine, tokenizer: Tokenizer, model_name: str, src, dst, progress=sys.stderr,
              defaults: GenerationDefaults | None = None,
              chat: ChatSettings = NO_CHAT, max_text_bytes: int = 0):
    """Run the batch file `src` (lines) into `dst`; returns (requests, failed, tokens, s).
    `defaults`: the model's sampling defaults (--generation-config); `chat`: the chat flags,
    as the gateway's; `max_text_bytes`: a pooling line's text limit (0: the default)."""
    runner = BatchRunner(engine, tokenizer, model_name, defaults, chat, max_text_bytes)
    items = [runner.parse(line) for line in src if line.strip()]
    start = time.monotonic()
    for item in items:
        runner.submit(item)
    total = [0]
    shown = [0.0]

    def on_step(tokens: int) -> None:
        total[0] += tokens
        now = time.monotonic()
        if progress is not None and (now - shown[0] > 0.2 or not runner.live):
            shown[0] = now
            done = sum(1 for i in items if not any(r in runner.live for r in i.choices))
            bar = "#" * (30 * done // max(len(items), 1))
            progress.write(f"\r[{bar:<30}] {done}/{len(items)} requests, {total[0]} tokens, "
                           f"{total[0] / max(now - start, 1e-9):.1f} tok/s")
            progress.flush()

    runner.run_pooled(items)
    runner.run(on_step)
    if progress is not None:
        progress.write("\n")
    for item in items:
        dst.write(json.dumps(runner.output(item), ensure_ascii=False) + "\n")
    failed = sum(item.error is not None for item in items)
    return len(items), failed, total[0], time.monotonic() - start
