"""Requests this gateway owns, and the routing of incoming deltas to them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shared.messages import Delta, DeltaBatch
from shared.state import api_id


@dataclass
class Inflight:
    """One API request. `deltas` receives its choices' Deltas (request ids '<id>:<index>')."""

    request_id: str
    n: int
    arrival: float = field(default_factory=time.time)  # wall clock, as compute and Redis see
    start: float = field(default_factory=time.monotonic)
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    got_output: bool = False


class Registry:
    def __init__(self):
        self.requests: dict[str, Inflight] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request_id: str, n: int) -> Inflight:
        req = self.requests[request_id] = Inflight(request_id, n)
        return req

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def dispatch(self, batch: DeltaBatch) -> None:
        for delta in batch.deltas:
            req = self.requests.get(api_id(delta.request_id))
            if req is not None:  # else: its client is gone
                req.got_output = True
                req.deltas.put_nowait(delta)

    def fail(self, message: str, only_waiting: bool = False) -> list[str]:
        """End requests with a 503 error (a service restarted); returns their ids."""
        failed = []
        for req in list(self.requests.values()):
            if only_waiting and req.got_output:
                continue
            req.deltas.put_nowait(Delta(req.request_id, error=message, error_status=503))
            failed.append(req.request_id)
        return failed
