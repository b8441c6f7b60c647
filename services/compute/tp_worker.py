"""A tensor-parallel rank other than 0 (a process rank 0 started, `tp.group.start`): it joins the
group, builds its ModelRunner (its shard of the weights, its heads of the KV cache) from rank
0's arguments, then runs each step's forward as rank 0 broadcasts it, until told to stop."""

from __future__ import annotations

import logging
import pickle
import sys

import torch.distributed as dist

from services.compute.tp.group import join
from services.compute.tp.step import broadcast

log = logging.getLogger(__name__)


def main(config, model_config, max_model_len: int, rank: int, port: int) -> None:
    """The process's body (its arguments come pickled on stdin: `python -m` this module)."""
    from services.compute.runner import ModelRunner

    ranks = join(config, rank, port)
    try:
        runner = ModelRunner(config, model_config, max_model_len, ranks)
        while (inputs := broadcast(None)) is not None:
            runner.forward_step(inputs)
    except (RuntimeError, ConnectionError) as e:  # gloo's error: a rank is gone
        log.error("tensor-parallel rank %d stops: %s", rank, e, exc_info=True)
        raise SystemExit(1) from None
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*pickle.load(sys.stdin.buffer))
