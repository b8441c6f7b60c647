"""`pipellm up`: Redis plus the four services as child processes, supervised.

Children get their settings as PIPELLM_* env vars (the one config path), die with the
supervisor (PR_SET_PDEATHSIG), are restarted when they crash, and are stopped on SIGINT/SIGTERM.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from shared.config import EngineConfig, ServiceConfig, env_for
from shared.redis_server import EmbeddedRedis

log = logging.getLogger("pipellm.up")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclasses.dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent)
        log.info("started %s (pid %d)", self.name, self.proc.pid)
        run_dir = self.env.get("PIPELLM_RUN_DIR")
        if run_dir:  # for operators and tests: which process is which
            with open(os.path.join(run_dir, f"{self.name}.pid"), "w") as f:
                f.write(str(self.proc.pid))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()


class Supervisor:
    def __init__(self, engine: EngineConfig, svc: ServiceConfig):
        self.svc = svc
        env = {**os.environ, **env_for(engine), **env_for(svc)}
        cmd = [sys.executable, "-m", "services.cli", "serve"]
        services = ["compute", "detokenizer"] + ["tokenizer"] * svc.tokenizer_workers
        services.append("gateway")
        names = services[:2] + [f"tokenizer-{i}" for i in range(svc.tokenizer_workers)]
        self.children = [Child(name, cmd + [service], env)
                         for name, service in zip(names + ["gateway"], services, strict=True)]
        self.stopping = False

    def start(self) -> None:
        for c in self.children:
            c.start()

    def check(self) -> None:
        """Restart children that exited (with a growing delay if they keep crashing)."""
        now = time.monotonic()
        for c in self.children:
            if c.proc is None or c.proc.poll() is None:
                continue
            if c.next_start == 0.0:
                log.error("%s exited with code %s; restarting", c.name, c.proc.returncode)
                c.restarts += 1
                c.next_start = now + min(0.2 * 2 ** min(c.restarts, 6), 10.0)
            elif now >= c.next_start:
                c.next_start = 0.0
                c.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        for c in self.children:
            c.stop()
        deadline = time.monotonic() + timeout_s
        for c in self.children:
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


def up(engine: EngineConfig, svc: ServiceConfig) -> int:
    own_run_dir = not svc.run_dir
    run_dir = svc.run_dir or tempfile.mkdtemp(prefix="pipellm-")
    redis_url = svc.redis_url or os.environ.get("REDIS_URL", "")
    embedded = None if redis_url else EmbeddedRedis(
        data_dir=svc.redis_dir or os.path.join(run_dir, "redis"), persist=bool(svc.redis_dir))
    if embedded is not None:
        os.makedirs(embedded.dir, exist_ok=True)
        embedded.start(preexec_fn=_die_with_parent)
        redis_url = embedded.url
        log.info("embedded redis at %s", redis_url)
        with open(os.path.join(run_dir, "redis.pid"), "w") as f:
            f.write(str(embedded.proc.pid))
    svc = dataclasses.replace(svc, run_dir=run_dir, redis_url=redis_url)
    sup = Supervisor(engine, svc)
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
                print(f"pipellm is up: http://{svc.host}:{svc.port}/v1 (model {engine.model})",
                      flush=True)
            time.sleep(0.2)
    finally:
        log.info("stopping")
        sup.stop()
        if embedded is not None:
            embedded.stop()
        if own_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0
