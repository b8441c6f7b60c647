"""A tensor-parallel rank other than 0 (a process rank 0 started, `tp.group.start`): it joins the
group, builds its ModelRunner (its shard of the weights, its heads of the KV cache) from rank
0's arguments, then follows rank 0's messages (`follow`: each step's forward, a pooling
forward, an adapter change) until told to stop."""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys

import torch
import torch.distributed as dist

from pipellm.services.compute.lora.attach import attach_adapters, detach_adapter
from pipellm.services.compute.pooling.forward import hidden_states
from pipellm.services.compute.tp.group import join
from pipellm.services.compute.tp.step import AdapterChange, StepInputs, broadcast
from pipellm.shared.lora import LoraError

log = logging.getLogger(__name__)


def main(config, model_config, max_model_len: int, rank: int, port: int) -> None:
    """The process's body (its arguments come pickled on stdin: `python -m` this module)."""
    from pipellm.services.compute.runner import ModelRunner

    ranks = join(config, rank, port)
    try:
        runner = ModelRunner(config, model_config, max_model_len, ranks)
        while (inputs := broadcast(None)) is not None:
            follow(runner, inputs)
    except (RuntimeError, ConnectionError) as e:  # gloo's error: a rank is gone
        log.error("tensor-parallel rank %d stops: %s", rank, e, exc_info=True)
        raise SystemExit(1) from None
    dist.destroy_process_group()


@torch.inference_mode()
def follow(runner, message: StepInputs | AdapterChange) -> None:
    """Do on this rank's ModelRunner what rank 0 does with `message`: a step's KV moves and
    its forward (whose logits rank 0 gathers), or a pooling forward (no LM head); or an
    adapter change (one rank 0 refused, every rank refuses alike, and rank 0 reports)."""
    if isinstance(message, AdapterChange):
        with contextlib.suppress(LoraError):
            if message.module is not None:
                attach_adapters(runner.model, [message.module], message.max_rank)
            else:
                detach_adapter(runner.model, message.name)
        return
    for src, dst, n in message.moves:
        runner.kv.move(src, dst, n)
    if message.pooled:
        hidden_states(runner.model, message.batch, runner.kv, message.rows)
    else:
        runner.model.forward_hidden(message.batch, runner.kv)


if __name__ == "__main__":
    main(*pickle.load(sys.stdin.buffer))
