"""The detokenizer process: everything after sampling.

Per StepOutput from compute: incremental detokenization (never a broken character), stop
strings (held back until they cannot match; a match tells compute to stop the request), the
split into reasoning and content (a route's reasoning parser), finish reasons and usage
counts, one batch of deltas per gateway, and one Redis pipeline of request state updates.
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass, field

import redis
import zmq

from pipellm.services.detokenizer.incremental import IncrementalDetokenizer
from pipellm.services.detokenizer.stop import StopMatcher
from pipellm.shared import state
from pipellm.shared.choice import api_id
from pipellm.shared.config import EngineConfig, ServiceConfig
from pipellm.shared.heap import settle_heap
from pipellm.shared.length_predictor import LengthPredictor, model_key
from pipellm.shared.messages import Abort, Delta, DeltaBatch, Route, StepOutput, Tokens
from pipellm.shared.reasoning import Splitter, parser
from pipellm.shared.tokenizer import load_tokenizer
from pipellm.shared.transport import Fanout, Receiver, Sender, Senders

log = logging.getLogger("pipellm.detokenizer")


@dataclass
class Stream:
    route: Route
    detok: IncrementalDetokenizer
    stops: StopMatcher
    started_at: float
    num_output: int = 0
    prompt: Tokens | None = None  # scored prompt pieces joined, until the first token
    skip: int = 0  # characters (reasoning, then content) its client already has (a resumed
    # choice), not re-sent
    splitter: Splitter | None = None  # with a reasoning parser


@dataclass
class Outputs:
    """What one StepOutput turns into."""

    deltas: dict[str, list[Delta]] = field(default_factory=dict)  # by gateway address
    stops: list[Abort] = field(default_factory=list)  # to compute: stop strings matched
    # Redis: (api request id, fields to set, ttl or None) and (api request id, counter, amount)
    updates: list[tuple[str, dict, int | None]] = field(default_factory=list)
    counts: list[tuple[str, str, int]] = field(default_factory=list)
    # the length predictor learns: (length features, output length) of finished requests, and
    # their ids (each is learned once, even if Redis fails and the update is sent again)
    lengths: list[tuple[list[int], int]] = field(default_factory=list)
    length_ids: list[str] = field(default_factory=list)

    def send(self, reply_to: str, delta: Delta) -> None:
        self.deltas.setdefault(reply_to, []).append(delta)


class Detokenizer:
    """Pure logic (no sockets, no Redis): StepOutput in, Outputs out."""

    def __init__(self, tokenizer, ttl_s: int):
        self.tokenizer, self.ttl_s = tokenizer, ttl_s
        self.streams: dict[str, Stream] = {}
        self.finished_choices: dict[str, int] = {}  # api id -> choices finished so far

    def handle(self, out: StepOutput) -> Outputs:
        res = Outputs()
        now = time.time()
        for route in out.routes:
            if route.request_id not in self.streams:
                self.streams[route.request_id] = self._open(route, now)
                res.updates.append((api_id(route.request_id),
                                    {"status": "running", "started_at": now}, None))
        for piece in out.prompt:
            stream = self.streams.get(piece.request_id)
            if stream is None:
                continue
            if stream.prompt is None:
                stream.prompt = piece
            else:
                stream.prompt.extend(piece)
        for tokens in out.outputs:
            stream = self.streams.get(tokens.request_id)
            if stream is not None:
                self._tokens(stream, tokens, res, now)
        for e in out.errors:
            res.send(e.reply_to, Delta(e.request_id, error=e.message, error_status=400,
                                       error_param=e.param))
            res.updates.append((api_id(e.request_id), {"status": "failed", "error": e.message},
                                self.ttl_s))
        for rid in out.aborted:
            self.streams.pop(rid, None)
        return res

    def _open(self, route: Route, now: float) -> Stream:
        s = Stream(route, IncrementalDetokenizer(self.tokenizer, list(route.prompt_tail),
                                                 route.skip_special_tokens),
                   StopMatcher(route.stop, route.include_stop_str_in_output), now)
        if route.reasoning_parser:
            s.splitter = Splitter(parser(route.reasoning_parser))
        r = route.resume
        if r is not None:  # replay what its client has: decoding, stop matching and the
            s.num_output = len(r.output_ids)  # split go on from there, held-back text included
            emitted, _ = s.stops.feed(s.detok.add(list(r.output_ids)))
            reasoning, content = s.splitter.feed(emitted) if s.splitter else ("", emitted)
            s.skip = max(r.sent_chars - len(reasoning) - len(content), 0)
        return s

    def _tokens(self, s: Stream, tokens: Tokens, res: Outputs, now: float) -> None:
        """A request's next output tokens: their text, stop strings, the finish."""
        fin = tokens.finish_reason
        s.num_output += len(tokens.token_ids)
        ids = tokens.token_ids
        if fin == "stop" and not s.route.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token (EOS, a stop_token_id) is not text, as in vLLM
        text = s.detok.add(ids)
        if fin is not None:
            text += s.detok.flush()
        emitted, matched = s.stops.feed(text)
        if matched:  # a stop string ends it, whatever compute's reason (a beam's length)
            if fin is None:
                res.stops.append(Abort(s.route.request_id, "stop"))
            fin = "stop"
        elif fin is not None:
            emitted += s.stops.flush()
        reasoning, content = _split(s, emitted, fin is not None)
        rid = s.route.request_id
        first = s.num_output == len(tokens.token_ids)
        delta = Delta(rid, content, tokens, fin, s.route.num_prompt, s.num_output,
                      reasoning=reasoning, stop_string=s.stops.stop)
        if first:
            delta.started_at, delta.cached_tokens = s.started_at, s.route.cached_tokens
            delta.prompt_ids = s.route.prompt_ids  # asked for, or with prompt logprobs
            if s.route.scores_prompt:
                delta.prompt = s.prompt or _no_logprobs(rid)
        res.send(s.route.reply_to, delta)
        if first:
            res.updates.append((api_id(rid), {"first_token_at": now}, None))
        if fin is not None:
            del self.streams[rid]
            self._finished(s, fin, res, now)

    def _finished(self, s: Stream, reason: str, res: Outputs, now: float) -> None:
        api = api_id(s.route.request_id)
        done = self.finished_choices.get(api, 0) + 1
        fields = {"prompt_tokens": s.route.num_prompt, "finish_reason": reason}
        if done == s.route.n:
            self.finished_choices.pop(api, None)
            fields.update(status="finished", finished_at=now)
            res.updates.append((api, fields, self.ttl_s))
        else:
            self.finished_choices[api] = done
            res.updates.append((api, fields, None))
        res.counts.append((api, "completion_tokens", s.num_output))
        if s.route.length_features:  # "stop" or "length": aborted requests never get here
            res.lengths.append((s.route.length_features, s.num_output))
            res.length_ids.append(s.route.request_id)


def _split(s: Stream, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of newly emitted text, less what a resumed client already has."""
    reasoning, content = ("", text) if s.splitter is None else s.splitter.feed(text)
    if final and s.splitter is not None:
        more_r, more_c = s.splitter.flush()
        reasoning, content = reasoning + more_r, content + more_c
    for_reasoning = min(s.skip, len(reasoning))
    for_content = min(s.skip - for_reasoning, len(content))
    s.skip -= for_reasoning + for_content
    return reasoning[for_reasoning:], content[for_content:]


def _no_logprobs(rid: str) -> Tokens:
    """A one-token prompt has no token to score."""
    return Tokens(rid, 1, array("i"), array("f"))


def write_state(client: redis.Redis, res: Outputs) -> None:
    """All of a step's request state changes in one round trip."""
    if not (res.updates or res.counts):
        return
    pipe = client.pipeline(transaction=False)
    for api, name, amount in res.counts:
        state.incr_request(pipe, api, name, amount)
    for api, fields, ttl in res.updates:
        state.set_request(pipe, api, ttl, **fields)
    pipe.execute()


def serve(engine_cfg: EngineConfig, svc: ServiceConfig) -> None:
    ctx = zmq.Context.instance()
    inbox = Receiver(ctx, svc.addr("detokenizer"), bind=True)
    control = Fanout([Sender(ctx, svc.addr("control", r))
                      for r in range(svc.data_parallel_size)])
    gateways = Senders(ctx)
    client = redis.Redis.from_url(svc.redis_url)
    detok = Detokenizer(load_tokenizer(engine_cfg.model), svc.request_ttl_s)
    predictor = LengthPredictor(state.fast_client(svc.redis_url), model_key(engine_cfg.model)) \
        if svc.length_predictor else None
    settle_heap(svc.gc_young_threshold)
    state.Heartbeat(client, svc.server, "detokenizer", svc.heartbeat_s)  # ready: live from here
    while True:
        msg = inbox.recv()
        if isinstance(msg, StepOutput):
            res = detok.handle(msg)
            for stop in res.stops:
                control.send(stop)
            for addr, deltas in res.deltas.items():
                gateways.send(addr, DeltaBatch(deltas))
            try:
                write_state(client, res)
            except redis.RedisError as e:
                log.warning("redis unavailable, request state not written: %s", e)
            if predictor is not None:
                # on Redis errors: kept, sent again with the next update, logged
                predictor.update_many(res.lengths, res.length_ids)
