"""The tensor-parallel group on one machine: rank 0 is the process that builds the engine (it
runs the scheduler and the sampling); it starts ranks 1..n-1 as child processes
(`python -m pipellm.services.compute.tp_worker`, their arguments pickled on stdin: no re-import of
the caller's main module, as multiprocessing's spawn would), which run the forward only and die
with rank 0 (PR_SET_PDEATHSIG). All n join torch.distributed's default process group
(gloo) through a TCPStore rank 0 serves on a free local port, or with --nnodes over 1 on
--master-addr:--master-port, where the other machines' ranks (`tp_node.py`) join it too.

Lifetime: rank 0's `Ranks.close()` (at the latest at interpreter exit) tells the others to stop
and ends the group. A rank that dies breaks its peers' next collective (gloo sees the closed
connection): a worker exits, rank 0's step raises.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipellm.services.compute.tp.shard import Shard, check, check_int4
from pipellm.services.compute.tp.step import broadcast
from pipellm.shared.child_process import die_with_parent

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# a collective's timeout: the other ranks wait in a broadcast for as long as rank 0 is idle
TIMEOUT = timedelta(days=7)
START_TIMEOUT_S = 300.0  # for the spawned ranks to reach the store


@dataclasses.dataclass
class Ranks:
    """This process's place in the group (torch.distributed's default group, joined): its
    shard, the ranks on this machine (`local`) and, on rank 0, the other ranks' processes on
    it and the store the group meets at."""

    shard: Shard
    local: int
    procs: list = dataclasses.field(default_factory=list)
    store: dist.TCPStore | None = None

    @property
    def leader(self) -> bool:
        """Whether this is rank 0 (it schedules, broadcasts the steps and samples)."""
        return self.shard.rank == 0

    def agree(self, capacity: int) -> int:
        """The KV slots every rank has room for: the least of each rank's `capacity` (the
        allocator, rank 0's, hands out slots every rank holds)."""
        t = torch.tensor([capacity], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def describe(self, device: str, weight_bytes: int, kv_bytes: int,
                 experts: range | None = None) -> dict:
        """Start-up's report (ModelRunner.summary) of the group: its ranks (and the whole
        experts each holds under expert parallelism: `experts`, this rank's), and the bytes of
        weights and KV cache summed over them (a collective: every rank calls it)."""
        t = torch.tensor([weight_bytes, kv_bytes], dtype=torch.int64)
        dist.all_reduce(t)
        weights, kv = (round(b / 2**30, 3) for b in t.tolist())
        ep = "" if experts is None else f", expert-parallel: {len(experts)} experts a rank"
        return {"device": f"{device} x {self.shard.size} tensor-parallel ranks{ep}",
                "weights_gib": weights, "kv_gib": kv}

    def close(self) -> None:
        """Rank 0: stop the other ranks, wait for them and end the group (once)."""
        if not self.leader or not dist.is_initialized():
            return
        atexit.unregister(self.close)
        try:
            broadcast(None)
        except RuntimeError as e:  # a rank already gone
            log.warning("tensor-parallel ranks did not all stop cleanly: %s", e)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.terminate()
        dist.destroy_process_group()
        self.store = None  # its server goes: another machine's ranks wait for the next one

    def abort(self) -> None:
        """Rank 0, its start-up failed: end the other ranks (wherever they are) and the
        group."""
        atexit.unregister(self.close)
        for p in self.procs:
            p.terminate()
            p.wait(timeout=30)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


def start(config, model_config, max_model_len: int, device) -> Ranks:
    """Rank 0's start-up: spawn ranks 1..n-1 (each building its ModelRunner from the same
    arguments) and join the group with them. RuntimeError if a rank dies before joining or a
    group already runs in this process."""
    size = config.tensor_parallel_size
    refuse(config, model_config, device)
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group already runs in this process (one engine "
                           "with --tensor-parallel-size at a time: close the other's runner)")
    local = size // config.nnodes  # ranks 0..local-1 here, the others on the other machines
    store = dist.TCPStore(meeting_host(config), config.master_port, size, is_master=True,
                          wait_for_workers=False, timeout=TIMEOUT)
    ranks = Ranks(shard_of(config, 0), local, store=store, procs=[
        spawn((config, model_config, max_model_len, rank, store.port))
        for rank in range(1, local)])
    try:
        _wait_started(store, ranks.procs, size)
        dist.init_process_group("gloo", store=store, rank=0, world_size=size, timeout=TIMEOUT)
    except BaseException:
        ranks.abort()
        raise
    atexit.register(ranks.close)
    return ranks


def join(config, rank: int, port: int) -> Ranks:
    """A spawned rank's start-up: join rank 0's group (waiting for its store to be up)."""
    size = config.tensor_parallel_size
    store = dist.TCPStore(meeting_host(config), port, size, is_master=False, timeout=TIMEOUT)
    store.set(f"started/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    return Ranks(shard_of(config, rank), size // config.nnodes)


def shard_of(config, rank: int) -> Shard:
    """Rank `rank`'s Shard of the group `config` describes."""
    return Shard(rank, config.tensor_parallel_size, config.enable_expert_parallel)


def meeting_host(config) -> str:
    """Where the ranks meet: node 0's --master-addr across machines, else this one."""
    return config.master_addr if config.nnodes > 1 else HOST


def refuse(config, model_config, device) -> None:
    """ValueError, one line, before any rank starts, where the group cannot run this model:
    shapes `size` does not divide (shard.check), a device (torch.device, resolved) other than
    the CPU, INT4 groups a rank's part would cut (shard.check_int4). A dense model runs
    --enable-expert-parallel as plain tensor parallelism (vLLM ignores the flag for it too)."""
    from pipellm.services.compute.model.quantization import gguf_int4

    size = config.tensor_parallel_size
    check(model_config, size, config.enable_expert_parallel)
    if config.enable_expert_parallel and not model_config.num_experts:
        log.info("--enable-expert-parallel: %s has no experts, its layers are split as "
                 "without it", model_config.architecture)
    if device.type != "cpu":
        raise ValueError(f"--tensor-parallel-size {size} runs on the CPU (gloo) only for now, "
                         f"not on {device}")
    blocks = config.quantization == "auto" and gguf_int4(config.model)  # Q4 blocks kept
    if blocks or config.quantization == "int4":
        check_int4(model_config, shard_of(config, 0), 32 if blocks else config.int4_group_size)


def spawn(args: tuple) -> subprocess.Popen:
    """A rank's process: tp_worker.main(*args), `args` pickled on its stdin."""
    root = str(Path(__file__).resolve().parents[4])  # the repository: the same code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "pipellm.services.compute.tp_worker"],
                            stdin=subprocess.PIPE, env=env, preexec_fn=die_with_parent)
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return proc


def _wait_started(store: dist.TCPStore, procs: list, size: int) -> None:
    """Wait until ranks 1..size-1 (`procs`: those spawned here, 1..) have reached the store;
    RuntimeError naming the first of `procs` that exited before (its own error is on its
    stderr), or on START_TIMEOUT_S (another machine's ranks missing)."""
    keys = [f"started/{rank}" for rank in range(1, size)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        for rank, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code "
                                   f"{p.returncode} before joining the group")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not start in {START_TIMEOUT_S} s "
                               "(with --nnodes: is every machine's --node-rank running?)")
        time.sleep(0.05)
