"""Launch an HTTP inference server as a child process group, wait until it is ready, stop it.

Used by bench/vs_peers.py for pipellm (`pipellm up`), vLLM (`vllm serve`) and llama.cpp. Each
server runs in its own session (process group), so stopping it stops every process it started:
SIGTERM to the group, then SIGKILL after a grace period. `running()` stops it on any exit from
its block, Ctrl-C and errors included; `terminate_on_sigterm()` turns SIGTERM into an exception
so that those blocks run when the benchmark itself is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import log
from pipellm.shared.redis_server import free_port  # noqa: F401  (the benches' servers take it here)


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with its last log lines."""


@dataclass
class Server:
    name: str
    argv: list[str]
    ready_url: str  # GET answers 200 once the server takes requests
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env},
                                         stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until `ready_url` answered 200; ServerError on exit or timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with code {self.proc.returncode} before "
                                  f"it was ready; log {self.log_path}:\n{self.log_tail()}")
            if http_ok(self.ready_url):
                return time.monotonic() - t0
            time.sleep(1.0)
        raise ServerError(f"{self.name} not ready after {timeout_s:.0f} s; log {self.log_path}:"
                          f"\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after `grace_s`."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # children that outlived the leader
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.proc = None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def running(server: Server, timeout_s: float):
    """Start `server`, wait for it (yields its start-up seconds), always stop it on exit."""
    try:
        server.start()
        yield server.wait_ready(timeout_s)
    finally:
        server.stop()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def terminate_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so `finally` blocks (server stops) run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def run_bench(args, argv: list[str], out: Path) -> dict | None:
    """One pipellm-bench run (`args.bench_timeout` s at most); its result JSON, or None (the
    reason logged) if it failed."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.bench_timeout)
    except subprocess.TimeoutExpired:
        log(f"pipellm-bench timed out after {args.bench_timeout:.0f} s")
        return None
    out.with_suffix(".txt").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        log(f"pipellm-bench failed (exit {proc.returncode}): {tail}")
        return None
    return json.loads(out.read_text(encoding="utf-8"))
