"""A machine other than node 0 of a tensor-parallel group across machines (`pipellm serve
--nnodes M --node-rank K`, K > 0): it runs only its ranks, K L .. K L + L - 1 with L = N / M,
no services. Each rank waits for rank 0's store at --master-addr:--master-port and joins the
group; when the group ends (rank 0 closed, or died and is being restarted by its supervisor)
the ranks exit and the node starts them again for the next group.

Every machine reads the same model path and settings from its own command line: the ranks
build their ModelRunner from this machine's, as rank 0 does from its own.
"""

from __future__ import annotations

import logging
import time

from services.compute.tp.group import spawn

log = logging.getLogger("pipellm.node")
RESTART_PAUSE_S = 1.0  # between one group's end and the next's start


def serve_node(config, groups: int | None = None) -> int:
    """Run this machine's ranks for group after group (`groups`: how many; None: until
    killed, its ranks dying with it). Returns 0."""
    from services.compute.backend import served_model

    model_config, context = served_model(config)
    local = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * local
    served = 0
    while groups is None or served < groups:
        procs = [spawn((config, model_config, context, rank, config.master_port))
                 for rank in range(first, first + local)]
        log.info("ranks %d..%d waiting for rank 0 at %s:%d", first, first + local - 1,
                 config.master_addr, config.master_port)
        codes = [p.wait() for p in procs]
        served += 1
        log.info("the group ended (ranks' exit codes %s): waiting for the next one", codes)
        time.sleep(RESTART_PAUSE_S)
    return 0
