"""Compute's start-up warm-up: whatever is compiled or initialised on first use (the C++ CPU
kernels, Triton's JIT on a GPU, oneDNN primitives, the allocator's pools) happens before compute
reports ready (its heartbeat, hence the gateway's /health), not on the first request."""

from __future__ import annotations

import logging
import time

from pipellm.kernels import dispatch
from pipellm.services.compute.engine import LLMEngine
from pipellm.shared.sampling import InvalidParams, SamplingParams

log = logging.getLogger("pipellm.compute")
_PROMPT_TOKENS = 32


def warm_up(engine: LLMEngine) -> str:
    """Build (or load) the C++ CPU kernels where `engine` runs them, then run two requests
    (greedy, sampled) through a prefill and a decode step on a throwaway engine over the same
    runner: the normal path, while `engine` itself (its requests, scheduler, KV allocator,
    prefix cache, length heads, stats) never sees them. Their KV slots belong to no one, and a
    later prefill overwrites them before anything reads them. Returns what it did, one line
    for the banner: 'C++ CPU kernels built in 48.2 s; warm-up 0.3 s' (and where the model's
    decode layers run fused, that they do)."""
    if engine.runner.simulated:
        return ""
    done = []
    device = getattr(engine.runner, "device", None)
    if device is not None and device.type == "cpu" and dispatch.backend() == "auto":
        from pipellm.kernels.cpu import build

        done.append(build())
    start = time.monotonic()
    limit = min(engine.max_model_len, engine.runner.capacity) - 3  # prompt + 2 tokens fit
    n, vocab = max(1, min(_PROMPT_TOKENS, limit)), engine.model_config.vocab_size
    prompts = [[(7 + 13 * i + j) % vocab for i in range(n)] for j in (0, 1)]
    params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=2, top_k=50, top_p=0.9, seed=0, ignore_eos=True)]
    try:
        if engine.config.pooling:  # the prefill-only forward and the pooling, once
            engine.embed(prompts)
            if engine.scoring.scoring.scores:  # and the head (a bad one fails start-up)
                engine.classify(prompts)
        else:
            LLMEngine(engine.config, engine.runner).generate(prompts, params)
    except InvalidParams as e:  # an engine too small for it still serves what fits
        log.warning("warm-up skipped (%s): the first request may be slow", e)
        return "; ".join([*done, "warm-up skipped"])
    seconds = time.monotonic() - start
    log.info("warm-up: 2 requests, a %d-token prefill and a decode step, in %.2f s", n, seconds)
    fused = getattr(engine.runner.model, "fused", None) is not None  # model/fused_decode.py
    return "; ".join([*done, f"warm-up {seconds:.1f} s",
                      *(["decode steps' layers in one C++ call"] if fused else [])])
