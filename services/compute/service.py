"""The compute process: the engine loop between the tokenizers and the detokenizer.

Each turn drains requests and control messages (without waiting while the engine has work),
runs one merged step, and sends everything the step produced to the detokenizer as one
StepOutput. Only token ids, logprobs and finish reasons leave this process.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import redis
import zmq

from services.compute.backend import build_engine
from services.compute.engine import LLMEngine
from services.compute.length.store import redis_stores
from services.compute.structured import GrammarQueue
from services.compute.warmup import warm_up
from shared import state
from shared.config import EngineConfig, ServiceConfig
from shared.length_dist import LengthDist
from shared.messages import Abort, GenerateRequest, Route, StepOutput, Tokens
from shared.sampling import InvalidParams
from shared.transport import Receiver, Sender

_EARLY_ABORT_TTL_S = 60.0


class ComputeService:
    def __init__(self, engine: LLMEngine, svc: ServiceConfig, redis_client: redis.Redis,
                 startup: str = ""):
        """`startup`: what start-up compiled and warmed (warmup.warm_up), for the banner."""
        self.engine, self.svc, self.redis = engine, svc, redis_client
        self.startup = startup
        ctx = zmq.Context.instance()
        rank = svc.data_parallel_rank
        self.inbox = Receiver(ctx, svc.addr("compute", rank), bind=True)
        self.control = Receiver(ctx, svc.addr("control", rank), bind=True)
        self.outbox = Sender(ctx, svc.addr("detokenizer"))
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.sock, zmq.POLLIN)
        self.poller.register(self.control.sock, zmq.POLLIN)
        self.routes: dict[str, Route] = {}  # live requests
        self.beam_choices: dict[str, list[str]] = {}  # beam search: its choices' ids
        self.early_aborts: dict[str, float] = {}  # aborts that overtook their request
        self.grammars = GrammarQueue(engine.config.model)
        state.Heartbeat(redis_client, svc.server, "compute", svc.heartbeat_s, rank=rank)
        self._next_stats = 0.0
        self.received = [0, 0]  # routed KV tokens, tokens to prefill: since the last stats
        try:
            state.reset_pending(redis_client, svc.server, rank)
        except redis.RedisError:
            pass  # the heartbeat thread reports the outage

    def run(self, stop=lambda: False) -> None:
        while not stop():  # idle: wait for messages (briefly while grammars compile)
            self.poll(timeout_ms=0 if self.engine.has_work() else
                      1 if self.grammars.waiting else 50)
            if self.engine.has_work():
                self.outbox.send(self.step())
            else:
                self.engine.tick()  # what the last requests taught still reaches Redis
            self.beat()

    def poll(self, timeout_ms: int) -> None:
        """Take in what arrived; refusals and aborts go to the detokenizer at once."""
        errors: list[list[str]] = []
        aborted: list[str] = []
        if self.poller.poll(timeout_ms):
            for msg in self.control.drain():
                self._control(msg, aborted)
            for msg in self.inbox.drain():
                if isinstance(msg, GenerateRequest):
                    if msg.routed_tokens:
                        self.received[0] += msg.routed_tokens
                        self.received[1] += msg.prefill_tokens
                    self._add(msg, errors)
        for req, grammar in self.grammars.ready():
            self._admit(req, grammar, errors)
        if errors or aborted:
            self.outbox.send(StepOutput([], errors=errors, aborted=aborted,
                                        step_time=time.time()))

    def _add(self, req: GenerateRequest, errors: list[list[str]]) -> None:
        if req.grammar is not None:  # admitted once compiled (poll)
            self.grammars.submit(req.grammar, req)
        else:
            self._admit(req, None, errors)

    def _admit(self, req: GenerateRequest, grammar, errors: list[list[str]]) -> None:
        """Into the engine, unless aborted meanwhile; `grammar`: its LoadedGrammar, or the
        error that its compile raised (a GrammarError: the client's 400)."""
        rid = req.request_id
        if self.early_aborts.pop(rid, None) or self.early_aborts.pop(state.api_id(rid), None):
            return
        try:
            if isinstance(grammar, Exception):
                raise grammar
            predicted = LengthDist(tuple(req.predicted_length)) if req.predicted_length else None
            self.engine.add_request(list(req.prompt_ids), req.params, rid, predicted,
                                    list(req.output_ids), grammar)
        except (InvalidParams, ValueError, RuntimeError, ImportError) as e:  # GrammarError: 400
            errors.append([rid, req.route.reply_to, str(e)])
            return
        self.routes[rid] = req.route
        if req.params.beam_width:
            api, (_, attempt) = state.api_id(rid), state.choice_of(rid)
            self.beam_choices[rid] = [state.choice_id(api, i, attempt)
                                      for i in range(req.params.beam_n)]

    def _control(self, msg, aborted: list[str]) -> None:
        if isinstance(msg, Abort):
            ids = [r for r in self.routes if r == msg.request_id
                   or state.api_id(r) == msg.request_id]
            for rid in ids:
                self.engine.abort(rid)
                self.routes.pop(rid, None)
                aborted.extend(self.beam_choices.pop(rid, [rid]))
            if not ids:
                self.early_aborts[msg.request_id] = time.monotonic()

    def step(self) -> StepOutput:
        result = self.engine.step()
        # a route goes with every admission (a preempted request's again: harmless)
        routes = [replace(self.routes[r], request_id=c, cached_tokens=n)
                  for r, n in zip(result.admitted, result.cached_tokens, strict=True)
                  if r in self.routes for c in self.beam_choices.get(r, [r])]
        outputs = self._name_beams(result.outputs)
        for t in result.outputs:
            if t.finish_reason is not None:
                self.routes.pop(t.request_id, None)
                self.beam_choices.pop(t.request_id, None)
        return StepOutput(routes, outputs, result.prompt, step_time=time.time())

    def _name_beams(self, outputs: list[Tokens]) -> list[Tokens]:
        """A finished beam search's records (its n best, best first) named as its choices."""
        named, seen = [], {}
        for t in outputs:
            choices = self.beam_choices.get(t.request_id)
            if choices is not None:
                i = seen[t.request_id] = seen.get(t.request_id, -1) + 1
                t = replace(t, request_id=choices[i])
            named.append(t)
        return named

    def beat(self) -> None:
        """Every heartbeat period: expire stale early aborts, publish engine stats."""
        now = time.monotonic()
        if now < self._next_stats:
            return
        self._next_stats = now + self.svc.heartbeat_s
        self.early_aborts = {k: t for k, t in self.early_aborts.items()
                             if now - t < _EARLY_ABORT_TTL_S}
        try:
            rank = self.svc.data_parallel_rank
            pipe = self.redis.pipeline(transaction=True)  # demand and pending change together
            state.set_stats(pipe, self.svc.server, rank, {
                **vars(self.engine.stats()), **self.engine.runner.summary,
                "max_model_len": self.engine.max_model_len, "startup": self.startup,
                "enable_prefix_caching": self.engine.config.scheduler.enable_prefix_caching,
                "rank": rank}, ttl_s=max(60.0, 10 * self.svc.heartbeat_s))
            state.settle_pending(pipe, self.svc.server, rank, *self.received)
            pipe.execute()
            self.received = [0, 0]
        except redis.RedisError:
            pass  # the heartbeat thread reports the outage


def serve(engine_cfg: EngineConfig, svc: ServiceConfig) -> None:
    stores = partial(redis_stores, state.fast_client(svc.redis_url), engine_cfg.model) \
        if svc.length_predictor else None  # else each compute process learns alone
    engine = build_engine(engine_cfg, length_stores=stores)
    startup = warm_up(engine)  # before the heartbeat starts: /health is green only after it
    ComputeService(engine, svc, redis.Redis.from_url(svc.redis_url), startup).run()
