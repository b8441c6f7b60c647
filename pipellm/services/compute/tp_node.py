"""A machine other than node 0 of tensor-parallel groups across machines (`pipellm serve
--nnodes M --node-rank K`, K > 0): it runs only its ranks, K L .. K L + L - 1 with L = N / M,
of each of the --data-parallel-size D replicas' groups, no services. Replica d's ranks wait
for its rank 0's store at --master-addr:replica_master_port(d) and join that group; when a
group ends (its rank 0 closed, or died and is being restarted by node 0's supervisor) its
ranks exit and the node starts them again for that replica's next group, the other replicas'
ranks untouched.

Every machine reads the same model path and settings from its own command line: the ranks
build their ModelRunner from this machine's, as rank 0 does from its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import time

from pipellm.services.compute.tp.group import spawn
from pipellm.shared.config import EngineConfig, replica_master_port

log = logging.getLogger("pipellm.node")
RESTART_PAUSE_S = 1.0  # between one group's end and the next's start
POLL_S = 0.2


@dataclasses.dataclass
class Replica:
    """This machine's ranks of one data-parallel replica's group: `config` (its meeting port
    and threads), the running processes (none between groups) and the groups served."""

    index: int
    config: EngineConfig
    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    served: int = 0
    next_start: float = 0.0  # monotonic time its next group's ranks start


def replica_config(config: EngineConfig, replica: int, replicas: int) -> EngineConfig:
    """Replica `replica`'s (of `replicas`) settings on this node: its meeting port and,
    without --threads, its ranks' share of the cores (D L ranks here)."""
    threads = config.threads
    if threads == 0 and replicas > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        threads = max(cores // (replicas * (config.tensor_parallel_size // config.nnodes)), 1)
    return dataclasses.replace(config, master_port=replica_master_port(config, replica),
                               threads=threads)


def serve_node(config: EngineConfig, replicas: int = 1, groups: int | None = None) -> int:
    """Run this machine's ranks of each of `replicas` groups, group after group, each replica
    on its own (`groups`: how many a replica; None: until killed, the ranks dying with this
    process). Returns 0."""
    from pipellm.services.compute.backend import served_model

    model_config, context = served_model(config)
    local = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * local
    todo = [Replica(d, replica_config(config, d, replicas)) for d in range(replicas)]
    while todo:
        now = time.monotonic()
        for r in todo:
            if r.procs and all(p.poll() is not None for p in r.procs):
                r.served += 1
                log.info("replica %d: its group ended (ranks' exit codes %s): waiting for the "
                         "next one", r.index, [p.returncode for p in r.procs])
                r.procs, r.next_start = [], now + RESTART_PAUSE_S
            if not r.procs and now >= r.next_start and (groups is None or r.served < groups):
                r.procs = [spawn((r.config, model_config, context, rank, r.config.master_port))
                           for rank in range(first, first + local)]
                log.info("replica %d: ranks %d..%d waiting for rank 0 at %s:%d", r.index, first,
                         first + local - 1, config.master_addr, r.config.master_port)
        todo = [r for r in todo if r.procs or groups is None or r.served < groups]
        time.sleep(POLL_S)
    return 0
