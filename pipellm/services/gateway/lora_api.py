"""vLLM's runtime LoRA endpoints, served with --allow-runtime-lora-updating (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true):

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}   200 once every compute serves it
    POST /v1/unload_lora_adapter  {"lora_name"}                200; requests naming it 404

Adapters loaded at run time are kept in Redis (pipellm.shared.state.lora_key): a restarted compute
loads them again before it is healthy, a restarted gateway lists them.

A load is checked here first (its adapter_config.json, --max-lora-rank, --max-cpu-loras, a
name not in use), then sent to every compute, and answered once each one's stats list it. An unload
takes the name out of the API at once; compute drops the weights when its last request of the
adapter has finished, so no stream is cut.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import redis.asyncio as aioredis
from aiohttp import web

from pipellm.services.gateway.errors import bad_request, not_found, unavailable
from pipellm.services.gateway.json_body import read_json_body
from pipellm.services.gateway.validation import get_str
from pipellm.shared import state
from pipellm.shared.lora import AdapterConfig, LoraError, LoraModule
from pipellm.shared.messages import LoraUpdate

LOAD_TIMEOUT_S = 60.0
SEND_WAIT_MS = 1000


def runtime_updates_allowed(flag: bool) -> bool:
    """--allow-runtime-lora-updating, or vLLM's environment variable set true."""
    return flag or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in (
        "1", "true")


class LoraAPI:
    def __init__(self, gw, max_cpu_loras: int | None, max_lora_rank: int):
        """`max_cpu_loras`: the most adapters loaded at once (None: any number)."""
        self.gw, self.max_cpu_loras, self.max_lora_rank = gw, max_cpu_loras, max_lora_rank
        self._lock = asyncio.Lock()  # one update at a time

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/load_lora_adapter", self.load)
        router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        body = await read_json_body(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        async with self._lock:
            gw = self.gw
            if name == gw.model_name or name in gw.adapter_names:
                raise bad_request(f"The lora adapter '{name}' has already been loaded.",
                                  "lora_name")
            limit = self.max_cpu_loras
            if limit is not None and len(gw.adapters) >= limit:
                raise bad_request(f"{len(gw.adapters)} LoRA adapters are loaded, "
                                  f"--max-cpu-loras is {limit}: unload one first", "lora_name")
            try:
                rank = AdapterConfig.read(path).rank
            except LoraError as e:
                raise bad_request(str(e), "lora_path") from None
            if rank > self.max_lora_rank:
                raise bad_request(f"LoRA adapter '{name}' has rank {rank}, over "
                                  f"--max-lora-rank {self.max_lora_rank}", "lora_path")
            await self._send(LoraUpdate(name, path))
            await self._until_loaded(name, path)
            await self._record(gw.redis.hset(state.lora_key(gw.svc.server), name, path))
            gw.set_adapters((*gw.adapters, LoraModule(name, path)))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = _field(await read_json_body(request), "lora_name")
        async with self._lock:
            gw = self.gw
            if name not in gw.adapter_names:
                raise not_found(f"The lora adapter '{name}' cannot be found.", "lora_name",
                                "model_not_found")
            gw.set_adapters(tuple(a for a in gw.adapters if a.name != name))
            await self._record(gw.redis.hdel(state.lora_key(gw.svc.server), name))
            await self._send(LoraUpdate(name))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    @staticmethod
    async def _record(write) -> None:
        """Note the change in Redis, for the services that start later; 503 without Redis."""
        try:
            await write
        except aioredis.RedisError:
            raise unavailable("Redis is unavailable.") from None

    async def _send(self, update: LoraUpdate) -> None:
        """To every compute; 503 where one does not take it within a second."""
        if not await self.gw.to_control.send(update, SEND_WAIT_MS):
            raise unavailable("A compute process is not connected; retry.")

    async def _until_loaded(self, name: str, path: str) -> None:
        """Wait until every compute's published stats list `name` as loaded; a 400 with the
        reason where one could not load it, a 503 after LOAD_TIMEOUT_S."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            await self.gw.health.refresh()
            engines = self.gw.metrics.engines
            for e in engines:
                failed = json.loads(e.get("lora_failed") or "{}").get(name)
                if failed is not None and failed[0] == path:
                    raise bad_request(failed[1], "lora_path")
            if engines and all(name in e.get("lora_loaded", "").split(",") for e in engines):
                return
            await asyncio.sleep(0.05)
        raise unavailable(f"LoRA adapter '{name}' was not loaded in {LOAD_TIMEOUT_S:.0f} s "
                          "(see compute's log)")


def _field(body, key: str) -> str:
    value = get_str(body, key, "") if isinstance(body, dict) else ""
    if not value:
        raise bad_request(f"{key} is required", key)
    return value
