"""The garbage collector's settings for a serving process, applied once it has started.

A service allocates a few objects per streamed token (messages, arrays, dicts, chunks), nearly
all freed by reference counting at once, while a thousand requests in flight keep theirs for
the request's length: CPython's default young threshold (700) then runs collections back to
back, each walking what the live requests hold (docs/benchmarks.md, "The serving path's CPU
per token").
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
