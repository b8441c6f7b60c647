"""Admission by count: how many generation requests this gateway holds, from the moment a
handler starts (before it reads the body) until it returns."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pipellm.services.gateway.errors import too_many_requests


class PendingLimit:
    """At most `limit` requests held at once; the rest get 429 with Retry-After.

    Invariant: `count` is the number of live `hold()` blocks. The check and the increment run
    with no await between them (one event loop), so a burst can never overshoot `limit`,
    whatever the handlers await later (Redis, the tokenizer, the stream)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def __len__(self) -> int:
        return self.count

    @contextmanager
    def hold(self) -> Iterator[None]:
        if self.count >= self.limit:
            raise too_many_requests("The server is at capacity; retry shortly.")
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
