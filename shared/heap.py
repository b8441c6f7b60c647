"""The garbage collector's settings for a serving process, applied once it has started.

A service allocates a few objects per streamed token (messages, arrays, dicts, chunks), nearly
all freed by reference counting at once. With CPython's default thresholds (a young collection
every 700 net allocations) and a thousand requests in flight, whose objects live for the
request's length, collections ran back to back and full ones walked every live request: 36% of
the gateway's CPU in a burst of 1,000 (docs/benchmarks.md, "The wire codec").
"""

from __future__ import annotations

import gc


def settle_heap(young_threshold: int) -> None:
    """Collect what start-up left, freeze the survivors (modules, the model's wrappers,
    tokenizer tables) out of every later collection, as vLLM's engine does once started, and
    collect the young generation every `young_threshold` net allocations (--gc-young-threshold);
    the older generations keep CPython's ratios to it."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *gc.get_threshold()[1:])
