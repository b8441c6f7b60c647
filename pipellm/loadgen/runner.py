"""Run a workload against a server: each item sent at its arrival offset, at most
`max_concurrency` in flight (a request that arrives while all slots are busy waits for one;
the wait is its `queue_time`), after optional warm-up requests that are not measured.

The run's clock starts just before the first request is due; `duration` runs from there until
the last response ends, and records' `start_time`s are relative to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, replace

import aiohttp

from pipellm.loadgen import client
from pipellm.loadgen.client import Endpoint
from pipellm.loadgen.datasets import WorkItem
from pipellm.loadgen.metrics import RequestRecord, class_summary, per_request, summarize
from pipellm.loadgen.progress import Progress
from pipellm.loadgen.prompts import PromptModel, calibrate

_CALIBRATED: dict[tuple[str, str, str], PromptModel] = {}


@dataclass(frozen=True)
class RunConfig:
    endpoint: Endpoint
    max_concurrency: int | None = None
    warmup_requests: int = 0
    progress: bool = True


@dataclass(frozen=True)
class Server:
    """What `prepare` learned: the endpoint with its model set, and the context length if the
    server tells it."""

    endpoint: Endpoint
    max_model_len: int | None


def prepare(ep: Endpoint) -> Server:
    """Fill in the model (first of GET /v1/models unless set) and the server's context length."""
    return asyncio.run(_prepare(ep))


async def _prepare(ep: Endpoint) -> Server:
    async with client.session() as s:
        try:
            model, max_len = await client.first_model(s, ep.base_url)
        except (aiohttp.ClientError, KeyError, RuntimeError):
            if not ep.model:
                raise
            model, max_len = ep.model, None
    return Server(replace(ep, model=ep.model or model), max_len)


def prompt_model(ep: Endpoint) -> PromptModel | None:
    """The server's prompt model (`pipellm.loadgen.prompts.calibrate`), None if it reports no usage.
    Kept for the process's lifetime per (URL, endpoint, model): a sweep calibrates once."""
    key = (ep.base_url, ep.path, ep.model)
    if key not in _CALIBRATED:
        async def go() -> PromptModel | None:
            async with client.session() as s:
                return await calibrate(lambda text: client.prompt_tokens(s, ep, text))

        pm = asyncio.run(go())
        if pm is None:
            return None
        _CALIBRATED[key] = pm
    return _CALIBRATED[key]


def run(cfg: RunConfig, items: list[WorkItem], offsets: list[float],
        ) -> tuple[list[RequestRecord], float]:
    """(records in item order, duration in seconds). Every item needs a prompt."""
    if len(items) != len(offsets):
        raise ValueError("one arrival offset per item")
    if any(w.prompt is None for w in items):
        raise ValueError("items need prompts (see pipellm.loadgen.prompts.fill_prompts)")
    return asyncio.run(_run(cfg, items, offsets))


def benchmark(cfg: RunConfig, items: list[WorkItem], offsets: list[float],
              percentiles: list[float], metrics: list[str], slos: dict[str, float],
              ) -> dict:
    """`run`, then the summary and per-request arrays in one dict (vLLM's result keys); in a
    priority mix also `classes`, each class's TTFT and E2EL (`class_summary`: p50 and
    `percentiles`)."""
    records, duration = run(cfg, items, offsets)
    classes = class_summary(records, sorted({50.0, *percentiles}))
    return {**summarize(records, duration, percentiles, metrics, slos), **per_request(records),
            **({"classes": classes} if classes else {})}


async def _run(cfg: RunConfig, items: list[WorkItem], offsets: list[float],
               ) -> tuple[list[RequestRecord], float]:
    sem = (asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency
           else contextlib.nullcontext())
    async with client.session() as s:
        if cfg.warmup_requests and items:
            bar = Progress(cfg.warmup_requests, "warmup", cfg.progress)
            await asyncio.gather(*(_one(s, cfg.endpoint, items[0], sem, bar)
                                   for _ in range(cfg.warmup_requests)))
            bar.close()
        bar = Progress(len(items), "requests", cfg.progress)
        start = time.perf_counter()
        tasks = []
        for item, at in zip(items, offsets, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(s, cfg.endpoint, item, sem, bar)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    for r in records:
        r.start_time -= start
    return records, duration


async def _one(s: aiohttp.ClientSession, ep: Endpoint, item: WorkItem, sem,
               bar: Progress) -> RequestRecord:
    arrived = time.perf_counter()
    async with sem:
        rec = await client.send(s, replace(ep, model=item.model) if item.model else ep,
                                item.prompt, item.prompt_len, item.output_len, item.priority)
    rec.queue_time = rec.start_time - arrived
    rec.request_class = item.request_class
    bar.update(rec.success)
    return rec
