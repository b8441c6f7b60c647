"""Progress of a long load, for the start-up log: quiet when it is quick."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

log = logging.getLogger("pipellm.compute")


def progress(items: Iterable, total: int | None, what: str, *, after_s: float = 2.0,
             every_s: float = 1.0) -> Iterator:
    """Yield `items`; once `after_s` has passed, log how far along it is at most every
    `every_s` ("loading weights: [########            ] 40% (120/300), 3.2 s"), and a last
    line when done."""
    start = time.monotonic()
    last = start + after_s - every_s
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            share = (f"[{'#' * (20 * done // total):<20}] {100 * done // total}% ({done}/{total})"
                     if total else f"{done}")
            log.info("loading %s: %s, %.1f s", what, share, now - start)
    if time.monotonic() - start >= after_s:
        log.info("loaded %s: %d in %.1f s", what, done, time.monotonic() - start)
