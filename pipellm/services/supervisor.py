"""`pipellm serve` (alias `up`): Redis plus the four services as child processes, supervised.

Children get their settings as PIPELLM_* env vars (the one config path), die with the
supervisor (PR_SET_PDEATHSIG), are restarted when they crash (after 1, 2, 4 ... 60 s while they
keep crashing; a child that ran RESET_AFTER_S is forgiven), each crash reported with the child's
last line on stderr, and are stopped on SIGINT/SIGTERM. The embedded redis-server is a child like
the others: restarted on its port with its data (append-only file in its directory, kept for the
life of `up`), the services reconnect by themselves. Nothing starts when a port to bind is taken.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import redis

from pipellm.shared import state, tool_prompt
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.child_process import die_with_parent
from pipellm.shared.config import EngineConfig, ServiceConfig, replica_master_port
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.model_config import served_name
from pipellm.shared.redis_server import EmbeddedRedis
from pipellm.shared.settings import env_for

log = logging.getLogger("pipellm.up")
FIRST_DELAY_S, MAX_DELAY_S, RESET_AFTER_S = 1.0, 60.0, 30.0


@dataclasses.dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0  # crashes in a row (reset once it has run RESET_AFTER_S)
    next_start: float = 0.0  # monotonic time of the pending restart; 0: none pending
    started_at: float = 0.0
    stderr_tail: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=200))

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=die_with_parent,
                                     stderr=subprocess.PIPE)
        self.started_at = time.monotonic()
        threading.Thread(target=self._forward_stderr, args=(self.proc.stderr,),
                         daemon=True).start()
        log.info("started %s (pid %d)", self.name, self.proc.pid)
        run_dir = self.env.get("PIPELLM_RUN_DIR")
        if run_dir:  # for operators and tests: which process is which
            with open(os.path.join(run_dir, f"{self.name}.pid"), "w") as f:
                f.write(str(self.proc.pid))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def last_error(self) -> str:
        """The child's error: its last traceback's exception line, else its last non-empty
        stderr line (what an extension prints at exit after a traceback is passed over)."""
        lines = [line.rstrip() for line in self.stderr_tail if line.strip()]
        starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
        if starts:
            raised = [line for line in lines[starts[-1] + 1 :] if not line.startswith(" ")]
            if raised:
                return raised[0]
        return lines[-1].strip() if lines else "no output on stderr"

    def _forward_stderr(self, stream) -> None:
        """Copy the child's stderr to ours line by line, keeping the last lines."""
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            self.stderr_tail.append(line)
            sys.stderr.write(line)
        stream.close()


def compute_env(engine: EngineConfig, n: int, rank: int) -> dict[str, str]:
    """What compute process `rank` of n gets besides the common settings: its rank, its
    device (the rank-th visible GPU), where its tensor-parallel ranks meet with --master-port
    (replica_master_port) and, on a CPU without --threads, its share of the cores (each of
    its --tensor-parallel-size ranks on this machine: as much)."""
    if n == 1:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(n)]
    env = {"PIPELLM_DATA_PARALLEL_RANK": str(rank),
           "CUDA_VISIBLE_DEVICES": devices[rank % len(devices)]}
    if engine.master_port:
        env["PIPELLM_MASTER_PORT"] = str(replica_master_port(engine, rank))
    if engine.threads == 0:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        local = engine.tensor_parallel_size // engine.nnodes
        env["PIPELLM_THREADS"] = str(max(cores // (n * local), 1))
    return env


class Supervisor:
    """The children of `pipellm serve`: the embedded redis-server (when there is one) first, then
    the services; stopped in the reverse order."""

    def __init__(self, engine: EngineConfig, svc: ServiceConfig,
                 redis: EmbeddedRedis | None = None):
        self.svc = svc
        env = {**os.environ, **env_for(engine), **env_for(svc)}
        cmd = [sys.executable, "-m", "pipellm.services.cli", "service"]
        n = svc.data_parallel_size
        self.children = [Child("compute" if n == 1 else f"compute-{r}", cmd + ["compute"],
                               {**env, **compute_env(engine, n, r)}) for r in range(n)]
        self.children += [Child(name, cmd + [service], env) for name, service in
                          [("detokenizer", "detokenizer")]
                          + [(f"tokenizer-{i}", "tokenizer") for i in range(svc.tokenizers)]
                          + [("gateway", "gateway")]]
        self.redis = redis
        if redis is not None:
            self.children.insert(0, Child("redis", redis.argv(), env))

    def start(self) -> None:
        for c in self.children:
            c.start()
            if c.name == "redis":
                self.redis.wait_ready(c.proc)

    def check(self) -> None:
        """Restart children that exited, after a delay that doubles while they keep crashing."""
        now = time.monotonic()
        for c in self.children:
            if c.proc is None or c.proc.poll() is None:
                continue
            if c.next_start == 0.0:
                if now - c.started_at >= RESET_AFTER_S:
                    c.restarts = 0
                delay = min(FIRST_DELAY_S * 2 ** c.restarts, MAX_DELAY_S)
                c.restarts += 1
                log.error("%s exited with code %s (%s); restart %d in %.0f s", c.name,
                          c.proc.returncode, c.last_error(), c.restarts, delay)
                c.next_start = now + delay
            elif now >= c.next_start:
                c.next_start = 0.0
                c.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        services = [c for c in self.children if c.name != "redis"]
        self._stop(services, timeout_s)
        self._stop([c for c in self.children if c.name == "redis"], timeout_s)

    @staticmethod
    def _stop(children: list[Child], timeout_s: float) -> None:
        for c in children:
            c.stop()
        deadline = time.monotonic() + timeout_s
        for c in children:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def healthy(self) -> bool:
        host = "127.0.0.1" if self.svc.host in ("0.0.0.0", "") else self.svc.host
        url = f"http://{host}:{self.svc.port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False


def check_ports(svc: ServiceConfig) -> None:
    """Raise OSError naming the first address `up` would bind that is taken (the HTTP port, tcp
    zmq addresses), before anything starts."""
    addrs = [(svc.host or "0.0.0.0", svc.port, "--port")]
    for name in ("tokenizer", "compute", "control", "detokenizer", "gateway"):
        ranks = svc.data_parallel_size if name in ("compute", "control") else 1
        given = [svc.addr(name, r) for r in range(ranks)] if getattr(svc, f"{name}_addr") \
            else []
        for addr in (a for a in given if a.startswith("tcp://")):
            url = urllib.parse.urlsplit(addr)
            addrs.append((url.hostname or "0.0.0.0", url.port or 0, f"--{name}-addr"))
    for host, port, flag in addrs:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise OSError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror}; is "
                              "another server running there?") from None


def banner(engine: EngineConfig, svc: ServiceConfig) -> str:
    """What a user needs once the server is up: the URL, the model and how it runs, the KV
    cache, what compute built and warmed at start-up (compute's figures, from the stats it
    publishes in Redis)."""
    stats, client = {}, redis.Redis.from_url(svc.redis_url)
    for _ in range(20):  # compute publishes them every --heartbeat-s
        try:
            stats = state.decode_hash(client.hgetall(state.stats_key(svc.server)))
        except redis.RedisError:
            break
        if "device" in stats:
            break
        time.sleep(0.1)
    name = svc.served_model_name or served_name(engine.model)
    lines = [f"pipellm is up: http://{svc.host}:{svc.port}/v1 (model {engine.model})",
             f"  model {name!r}: {stats.get('dtype', '?')} on {stats.get('device', '?')}, "
             f"context {stats.get('max_model_len', engine.max_model_len)} tokens"
             + _weights(stats),
             f"  KV cache: {stats.get('capacity', '?')} tokens, {stats.get('kv_gib', '?')} GiB"
             + (f" ({kv})" if (kv := stats.get("kv_dtype", "auto")) != "auto" else "")]
    if stats.get("startup"):  # what compute compiled and warmed before it reported ready
        lines.append(f"  compute: {stats['startup']}")
    if engine.pooling:  # no sampling, no tools
        what = ("a reward model's per-token scores on /pooling" if engine.reward
                else "embeddings and scores (docs/usage.md, 'Embeddings')")
        lines.append(f"  pooling runner: {what}, no generation")
        return "\n".join(lines)
    lines.append(f"  {GenerationDefaults.of(engine).describe()}")  # --generation-config
    lines.append("  " + tool_prompt.describe(svc, load_chat_template(engine.model,
                                                                     engine.chat_template)))
    return "\n".join(lines)


def _weights(stats: dict) -> str:
    """', weights 0.08 GiB (int4)': what the torch backend publishes; '' for the simulator."""
    if "weights_gib" not in stats:
        return ""
    quant = stats.get("quantization", "none")
    return f", weights {stats['weights_gib']} GiB" + ("" if quant == "none" else f" ({quant})")


def default_server_id(port: int) -> str:
    """<host>-<port>: unique per machine and port (per container under compose), the same
    across restarts of one server."""
    return f"{socket.gethostname()}-{port}".replace(":", "-")


def up(engine: EngineConfig, svc: ServiceConfig) -> int:
    check_ports(svc)
    own_run_dir = not svc.run_dir
    run_dir = svc.run_dir or tempfile.mkdtemp(prefix="pipellm-")
    redis_url = svc.redis_url or os.environ.get("REDIS_URL", "")
    # the data dir outlives a redis-server crash (a temporary one: the life of `up`)
    embedded = None if redis_url else EmbeddedRedis(
        data_dir=svc.redis_dir or os.path.join(run_dir, "redis"), persist=True)
    if embedded is not None:
        os.makedirs(embedded.dir, exist_ok=True)
        redis_url = embedded.url
        log.info("embedded redis at %s (data in %s)", redis_url, embedded.dir)
    svc = dataclasses.replace(svc, run_dir=run_dir, redis_url=redis_url,
                              server_id=svc.server_id or default_server_id(svc.port))
    sup = Supervisor(engine, svc, embedded)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        sup.start()
        announced = False
        while not stop:
            sup.check()
            if not announced and sup.healthy():
                announced = True
                print(banner(engine, svc), flush=True)
            time.sleep(0.2)
    finally:
        log.info("stopping")
        sup.stop()
        if own_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0
