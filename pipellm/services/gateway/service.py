"""The gateway process: aiohttp server, delta reader and health monitor on one event loop."""

from __future__ import annotations

import asyncio
import logging

import redis
import redis.asyncio as aioredis
import zmq.asyncio
from aiohttp import web
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.driver_info import DriverInfo

from pipellm.services.gateway.app import Gateway
from pipellm.services.gateway.embeddings_request import EmbeddingSettings
from pipellm.services.gateway.lora_api import runtime_updates_allowed
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.config import EngineConfig, SchedulingPolicyName, ServiceConfig
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.heap import settle_heap
from pipellm.shared.lora import LoraModule, parse_lora_modules, runtime_adapters
from pipellm.shared.messages import DeltaBatch, EmbedResult
from pipellm.shared.model_config import ModelConfig, served_context, served_name
from pipellm.shared.pooling import PoolingConfig
from pipellm.shared.scoring import ScoringConfig
from pipellm.shared.tokenizer import load_tokenizer
from pipellm.shared.transport import AsyncFanout, AsyncReceiver, AsyncSender

log = logging.getLogger("pipellm.gateway")
LISTEN_BACKLOG = 2048


def build(engine_cfg: EngineConfig, svc: ServiceConfig) -> tuple[Gateway, AsyncReceiver]:
    ctx = zmq.asyncio.Context.instance()
    name = svc.served_model_name or served_name(engine_cfg.model)
    gw = Gateway(svc, name, served_context(engine_cfg),
                 load_tokenizer(engine_cfg.model),
                 redis_client(svc),
                 AsyncSender(ctx, svc.addr("tokenizer"), bind=True),
                 AsyncFanout([AsyncSender(ctx, svc.addr("control", r))
                              for r in range(svc.data_parallel_size)]),
                 load_chat_template(engine_cfg.model, engine_cfg.chat_template),
                 GenerationDefaults.of(engine_cfg),
                 lora_adapters(engine_cfg, svc),
                 (engine_cfg.max_cpu_loras, engine_cfg.max_lora_rank) if engine_cfg.enable_lora
                 and runtime_updates_allowed(svc.allow_runtime_lora_updating) else None,
                 embedding_settings(engine_cfg),
                 engine_cfg.scheduler.scheduling_policy != SchedulingPolicyName.FCFS)
    return gw, AsyncReceiver(ctx, svc.addr("gateway"), bind=True)


def embedding_settings(engine_cfg: EngineConfig) -> EmbeddingSettings | None:
    """What /v1/embeddings checks requests against on a pooling server; None otherwise."""
    if not engine_cfg.pooling:
        return None
    return EmbeddingSettings(True, PoolingConfig.resolve(engine_cfg.model,
                                                         engine_cfg.pooler_config),
                             ModelConfig.from_path(engine_cfg.model).hidden_size,
                             served_context(engine_cfg),
                             ScoringConfig.from_dir(engine_cfg.model, engine_cfg.hf_overrides,
                                                    engine_cfg.convert),
                             engine_cfg.reward)


def lora_adapters(engine_cfg: EngineConfig, svc: ServiceConfig) -> tuple[LoraModule, ...]:
    """With --enable-lora: --lora-modules', then those loaded at run time (lora_api.py)."""
    if not engine_cfg.enable_lora:
        return ()
    modules = parse_lora_modules(engine_cfg.lora_modules)
    names = {m.name for m in modules}
    client = redis.Redis.from_url(svc.redis_url)
    return (*modules, *(m for m in runtime_adapters(client, svc.server) if m.name not in names))


def redis_client(svc: ServiceConfig) -> aioredis.Redis:
    """The gateway's Redis client. Requests in flight are at most --max-pending (PendingLimit),
    each using one connection at a time; the margin serves health checks, aborts and
    /v1/requests. The pool blocks when all are busy instead of failing, so a burst past the
    margin waits rather than reads as "Redis unavailable". A pooled connection that died with a
    restarted Redis is retried on a fresh one (pool connections otherwise never retry). The
    library's version is given, not looked up: redis-py otherwise reads it from the package
    metadata for every new connection, and a burst opens a thousand (docs/benchmarks.md)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        svc.redis_url, max_connections=svc.max_pending + 32, timeout=5,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
        driver_info=DriverInfo(lib_version=redis.__version__))
    return aioredis.Redis(connection_pool=pool)


async def read_deltas(gw: Gateway, inbox: AsyncReceiver) -> None:
    """Hand each answer the services send to its waiter until cancelled."""
    def deliver(msg) -> None:
        if isinstance(msg, DeltaBatch):
            gw.registry.dispatch(msg)
        elif isinstance(msg, EmbedResult):
            gw.embeddings_api.deliver(msg)
    await inbox.serve(deliver)


async def resume_background(gw: Gateway) -> None:
    """Once the services are up, continue the background responses this server was running
    when its gateway stopped (responses_api/jobs.py)."""
    while not gw.health.ok:
        await asyncio.sleep(0.1)
    try:
        await gw.responses_api.jobs.resume()
    except Exception:  # the store is down: they stay in progress until a later restart
        log.exception("could not continue the background responses")


async def run(engine_cfg: EngineConfig, svc: ServiceConfig) -> None:
    gw, inbox = build(engine_cfg, svc)
    tasks = [asyncio.create_task(read_deltas(gw, inbox)),
             asyncio.create_task(gw.health.run(svc.heartbeat_s))]
    asyncio.create_task(resume_background(gw))  # noqa: RUF006 (ends by itself)
    runner = web.AppRunner(gw.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    # uvicorn's (vLLM's server) listen backlog: aiohttp's 128 can overflow when a benchmark
    # opens a thousand connections at once, and each dropped SYN costs its client a second
    await web.TCPSite(runner, svc.host, svc.port, backlog=LISTEN_BACKLOG).start()
    log.info("gateway on http://%s:%d serving %s", svc.host, svc.port, gw.model_name)
    settle_heap(svc.gc_young_threshold)
    try:
        await asyncio.gather(*tasks)
    finally:
        await runner.cleanup()


def serve(engine_cfg: EngineConfig, svc: ServiceConfig) -> None:
    asyncio.run(run(engine_cfg, svc))
