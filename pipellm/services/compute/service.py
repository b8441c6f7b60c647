"""The compute process: the engine loop between the tokenizers and the detokenizer.

Each turn drains requests and control messages (without waiting while the engine has work),
runs one merged step, and sends everything the step produced to the detokenizer as one
StepOutput. Only token ids, logprobs and finish reasons leave this process. A pooling
server's EmbedRequests run between steps (embed_core.py), their EmbedResults straight to the
gateway that asked (the detokenizer has nothing to do with them).
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial

import redis
import zmq

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.compute_core import ComputeCore
from pipellm.services.compute.embed_core import EmbedCore
from pipellm.services.compute.engine import EngineStats, LLMEngine
from pipellm.services.compute.length.store import redis_stores
from pipellm.services.compute.step_stats import StatsLine
from pipellm.services.compute.structured import GrammarQueue
from pipellm.services.compute.warmup import warm_up
from pipellm.shared import state
from pipellm.shared.config import EngineConfig, ServiceConfig
from pipellm.shared.heap import settle_heap
from pipellm.shared.lora import LoraModule, runtime_adapters
from pipellm.shared.messages import Abort, EmbedRequest, GenerateRequest, LoraUpdate
from pipellm.shared.transport import Receiver, Sender, Senders

log = logging.getLogger(__name__)


class ComputeService:
    """A ComputeCore between the sockets: requests and aborts in, StepOutputs out, and the
    engine's stats and heartbeat in Redis."""

    def __init__(self, engine: LLMEngine, svc: ServiceConfig, redis_client: redis.Redis,
                 startup: str, grammars: GrammarQueue):
        """`startup`: what start-up compiled and warmed (warmup.warm_up), for the banner;
        `grammars`: the compile queue, its compiler loaded."""
        self.core = ComputeCore(engine, grammars)
        self.embeds = EmbedCore(engine)
        self.engine = engine
        self.svc, self.redis, self.startup = svc, redis_client, startup
        ctx = zmq.Context.instance()
        rank = svc.data_parallel_rank
        self.inbox = Receiver(ctx, svc.addr("compute", rank), bind=True)
        self.control = Receiver(ctx, svc.addr("control", rank), bind=True)
        self.outbox = Sender(ctx, svc.addr("detokenizer"))
        self.replies = Senders(ctx)  # EmbedResults, to the gateway each request names
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.sock, zmq.POLLIN)
        self.poller.register(self.control.sock, zmq.POLLIN)
        state.Heartbeat(redis_client, svc.server, "compute", svc.heartbeat_s, rank=rank)
        self._next_stats = 0.0
        every = 0.0 if svc.disable_log_stats else svc.log_stats_interval
        self.stats_line = StatsLine(every) if every > 0 else None
        self.lora_failed: dict[str, list[str]] = {}  # the last adapter that failed to load:
        # its path and why
        self.received = [0, 0]  # routed KV tokens, tokens to prefill: since the last stats
        try:
            state.reset_pending(redis_client, svc.server, rank)
        except redis.RedisError:
            pass  # the heartbeat thread reports the outage

    def run(self, stop=lambda: False) -> None:
        while not stop():  # idle: wait for messages (briefly while grammars compile)
            self.poll(timeout_ms=0 if self.core.has_work() or self.embeds.has_work() else
                      1 if self.core.compiling() else 50)
            for reply_to, result in self.embeds.run():
                self.replies.send(reply_to, result)
            if self.core.has_work():
                self.outbox.send(self.core.step())
            else:
                self.engine.tick()  # what the last requests taught still reaches Redis
            self.beat()

    def poll(self, timeout_ms: int) -> None:
        """Take in what arrived; refusals and aborts go to the detokenizer at once."""
        if self.poller.poll(timeout_ms):
            for msg in self.control.drain():
                if isinstance(msg, Abort):
                    self.core.abort(msg.request_id)
                elif isinstance(msg, LoraUpdate):
                    self.update_lora(msg)
            for msg in self.inbox.drain():
                if isinstance(msg, GenerateRequest):
                    if msg.routed_tokens:
                        self.received[0] += msg.routed_tokens
                        self.received[1] += msg.prefill_tokens
                    self.core.submit(msg)
                elif isinstance(msg, EmbedRequest):
                    self.embeds.submit(msg)
        notices = self.core.notices()
        if notices is not None:
            self.outbox.send(notices)

    def update_lora(self, msg: LoraUpdate) -> None:
        """Load or unload an adapter; the next stats say which are loaded (the gateway waits
        for them), and why the last one that failed to load did not (it stays out)."""
        try:
            if msg.path:
                self.engine.adapters.load(LoraModule(msg.name, msg.path))
                self.lora_failed.pop(msg.name, None)
            else:
                self.engine.unload_lora(msg.name)
        except (ValueError, OSError, RuntimeError) as e:  # LoraError is a ValueError
            log.error("LoRA adapter %r (%s) not loaded: %s", msg.name, msg.path, e)
            self.lora_failed = {msg.name: [msg.path, str(e)]}
        self._next_stats = 0.0  # publish at once

    def beat(self) -> None:
        """Every heartbeat period: expire stale early aborts, publish engine stats."""
        now = time.monotonic()
        if now < self._next_stats:
            return
        self._next_stats = now + self.svc.heartbeat_s
        self.core.expire_early_aborts()
        try:
            rank = self.svc.data_parallel_rank
            stats = self.engine.stats()
            self.log_stats(stats)
            pipe = self.redis.pipeline(transaction=True)  # demand and pending change together
            state.set_stats(pipe, self.svc.server, rank, {
                **vars(stats), **self.engine.runner.summary,
                **self.engine.lora_info(),
                **({"lora_failed": json.dumps(self.lora_failed)} if self.lora_failed else {}),
                "max_model_len": self.engine.max_model_len, "startup": self.startup,
                "enable_prefix_caching": self.engine.config.scheduler.enable_prefix_caching,
                "rank": rank}, ttl_s=max(60.0, 10 * self.svc.heartbeat_s))
            state.settle_pending(pipe, self.svc.server, rank, *self.received)
            pipe.execute()
            self.received = [0, 0]
        except redis.RedisError:
            pass  # the heartbeat thread reports the outage

    def log_stats(self, stats: EngineStats) -> None:
        """The stats line, when one is due (step_stats.StatsLine)."""
        if self.stats_line is not None:
            text = self.stats_line.line(self.engine.counts, stats,
                                        self.engine.config.scheduler.enable_prefix_caching)
            if text:
                log.info("Engine %03d: %s", self.svc.data_parallel_rank, text)


def serve(engine_cfg: EngineConfig, svc: ServiceConfig) -> None:
    stores = partial(redis_stores, state.fast_client(svc.redis_url), engine_cfg.model) \
        if svc.length_predictor else None  # else each compute process learns alone
    grammars = GrammarQueue(engine_cfg.model)  # its compiler loads beside the engine's build
    engine = build_engine(engine_cfg, length_stores=stores)
    client = redis.Redis.from_url(svc.redis_url)
    if engine_cfg.enable_lora:
        load_runtime_adapters(engine, client, svc.server)
    startup = warm_up(engine)  # before the heartbeat starts: /health is green only after it
    grammars.compiler.wait()  # and the first requests do not share the GIL with its imports
    settle_heap(svc.gc_young_threshold)
    ComputeService(engine, svc, client, startup, grammars).run()


def load_runtime_adapters(engine: LLMEngine, client: redis.Redis, server: str) -> None:
    """The adapters loaded at run time before this compute (re)started (lora_api.py), those
    --lora-modules does not name; one that fails is logged and left out."""
    for module in runtime_adapters(client, server):
        if module.name not in engine.adapters.names:
            try:
                engine.adapters.load(module)
            except (ValueError, OSError, RuntimeError) as e:
                log.error("LoRA adapter %r (%s) not loaded: %s", module.name, module.path, e)
