"""Pooled embeddings of whole token-id prompts through an LLMEngine's model.

Prompts are checked first (none empty, none over the context, ids in the vocabulary:
InvalidParams), then run in batches of at most max(`max_batched_tokens`, MIN_BATCH_TOKENS)
prompt tokens (a prefill-only step has no decodes' latency to protect; a longer prompt runs
alone), each batch one prefill-only forward into KV slots taken from the engine's
allocator (a batch whose prompts do not all fit runs the head that does) and freed before the
next batch, whatever happens. Pooled by their last token, a batch's prompts that all start
with the same MIN_SHARED tokens or more (a reranker's query before each document) run that
prefix once: a forward of its own, its K/V copied into every prompt's slots, then the rest.
Requests the engine is running keep their slots: the pooled prompts only use free ones.
Result: [N, dim] float32 on the CPU, in prompt order (mode "all": [total tokens, dim], each
prompt's rows in turn).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from pipellm.services.compute.pooling.forward import prefill_batch
from pipellm.services.compute.pooling.pool import finish, pool, pooled_rows
from pipellm.shared.pooling import PoolingConfig
from pipellm.shared.sampling import InvalidParams

MIN_BATCH_TOKENS = 2048  # at least this per pooling forward (bench/pooling.py)
MIN_SHARED = 16  # a common prefix of the prompts of a forward this long is computed once


class NoKVRoom(RuntimeError):
    """Not even the first prompt of a batch gets free KV slots (it is longer than the free
    space: the cache is too small for it, or held by running requests)."""


def forward_budget(engine) -> int:
    """The prompt tokens one pooling forward takes (a longer prompt runs alone)."""
    return max(engine.config.scheduler.max_batched_tokens, MIN_BATCH_TOKENS)


def embed(engine, prompts: list[list[int]], pooling: PoolingConfig,
          dimensions: int | None = None, head: Callable | None = None) -> torch.Tensor:
    """[len(prompts), dim] float32: each prompt pooled by `pooling`, truncated to `dimensions`
    (None: the hidden size), normalized when `pooling.normalize`; with `head`, that of the
    pooled rows instead ([N, k]: scoring.ScoringHead)."""
    runner = engine.runner
    if getattr(runner, "simulated", False):
        raise ValueError("pooling needs a model: the sim backend has none")
    hidden = engine.model_config.hidden_size
    try:
        dim = pooling.output_dim(dimensions)
        if dim is not None and dim > hidden:
            raise ValueError(f"dimensions must be <= the hidden size {hidden}, got {dim}")
    except ValueError as e:
        raise InvalidParams("dimensions", str(e)) from None
    check_prompts(prompts, engine.max_model_len, engine.model_config.vocab_size)
    if not prompts:
        return torch.zeros(0, dim or hidden) if head is None else head(torch.zeros(0, hidden))
    out, budget = [], forward_budget(engine)
    while prompts:
        group = next(batches(prompts, budget))
        vectors, done = _run_group(engine, group, pooling, dim, head)
        out.append(vectors)
        prompts = prompts[done:]
    return torch.cat(out)


def _run_group(engine, group: list[list[int]], pooling: PoolingConfig,
               dim: int | None, head: Callable | None = None) -> tuple[torch.Tensor, int]:
    """The pooled vectors of the longest head of `group` whose prompts get free KV slots
    (NoKVRoom when not even the first does), and how many prompts that head holds; the slots
    are freed before returning."""
    allocator, runner, starts = engine.kv.allocator, engine.runner, []
    try:
        for p in group:
            start = allocator.allocate(len(p))
            if start is None:
                break
            starts.append(start)
        if not starts:
            raise NoKVRoom(f"no {len(group[0])} free KV slots for a pooled prompt")
        group = group[:len(starts)]
        shared = shared_prefix(group) if pooling.mode == "last" else 0
        moves = _prefill_shared(runner, group[0][:shared], starts)
        batch = prefill_batch(group, starts, runner.device, shared)
        lens = [len(p) - shared for p in group]  # the rows each prompt has in `batch`
        keep = pooled_rows(lens, pooling.mode)  # last or first rows: the last MLP on those alone
        hidden = runner.pooled_hidden(batch, None if keep is None else keep.to(runner.device),
                                      moves)
        vectors = hidden.float() if keep is not None else pool(hidden, lens, pooling.mode)
        if head is not None:
            return head(vectors).cpu(), len(group)
        return finish(vectors, pooling.normalize, dim).cpu(), len(group)
    finally:
        for start in starts:
            allocator.free(start)


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many tokens every one of `prompts` starts with, to run once for all (a reranker's
    instruction and query before each document, an embedder's instruction before each query):
    0 for fewer than two prompts or a prefix under MIN_SHARED tokens; at most the shortest
    prompt's length - 1, so that each prompt keeps a row of its own to pool."""
    if len(prompts) < 2:
        return 0
    n = min(len(os.path.commonprefix(prompts)), min(map(len, prompts)) - 1)
    return n if n >= MIN_SHARED else 0


def _prefill_shared(runner, prefix: list[int], starts: list[int]) -> list[tuple[int, int, int]]:
    """The K/V of `prefix` written into the first prompt's slots (at starts[0]) by a forward of
    its own, and the moves (src, dst, n) that copy it into the other prompts' (none for an
    empty prefix)."""
    if not prefix:
        return []
    n = len(prefix)
    last = torch.tensor([n - 1], device=runner.device)  # a row the forward must keep
    runner.pooled_hidden(prefill_batch([prefix], starts[:1], runner.device), last)
    return [(starts[0], start, n) for start in starts[1:]]


def check_prompts(prompts: list[list[int]], max_len: int, vocab: int) -> None:
    """InvalidParams for an empty prompt, one over `max_len` tokens or an id outside the vocab."""
    for i, p in enumerate(prompts):
        if not p:
            raise InvalidParams("input", f"prompt {i} is empty: pooling needs at least one token")
        if len(p) > max_len:
            raise InvalidParams("input", f"prompt {i} has {len(p)} tokens, over the context of "
                                f"{max_len}")
        if min(p) < 0 or max(p) >= vocab:
            raise InvalidParams("input", f"prompt {i} has a token id outside 0..{vocab - 1}")


def batches(prompts: list[list[int]], budget: int) -> Iterator[list[list[int]]]:
    """Consecutive groups of `prompts` of at most `budget` tokens each (a longer prompt alone)."""
    group, tokens = [], 0
    for p in prompts:
        if group and tokens + len(p) > budget:
            yield group
            group, tokens = [], 0
        group.append(p)
        tokens += len(p)
    if group:
        yield group
