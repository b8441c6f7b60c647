"""A real pipellm stack for end-to-end tests: `pipellm up` in a subprocess, real Redis."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import ClassVar

from pipellm.shared.redis_server import EmbeddedRedis, free_port


class Stack:
    """`embedded_redis`: `pipellm up` runs (and supervises) its own redis-server; `redis_url`:
    it uses that one (several stacks may share it); otherwise the test owns one (`self.redis`)
    and passes --redis-url. `new_session`: `pipellm up` leads its own process group (which a
    test may kill whole); else it is in the test's. `live`: the stacks started and not yet
    stopped (a failing test's report carries their logs: tests/conftest.py)."""

    live: ClassVar[set[Stack]] = set()

    def __init__(self, model_dir: Path, *extra: str, embedded_redis: bool = False,
                 redis_url: str = "", new_session: bool = False):
        self.run_dir = tempfile.mkdtemp(prefix="pl-")  # short: ipc paths are limited to 107
        self.redis = None
        self.redis_url = redis_url
        self.new_session = new_session
        if not embedded_redis and not redis_url:
            self.redis = EmbeddedRedis(data_dir=os.path.join(self.run_dir, "redis"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir = model_dir
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> Stack:
        redis = ["--redis-url", self.redis_url] if self.redis_url else []
        if self.redis is not None:
            self.redis.start()
            redis = ["--redis-url", self.redis.url]
        for attempt in range(3):  # a free port may be taken (an outgoing connection's) by then
            argv = [sys.executable, "-m", "pipellm.services.cli", "up",
                    "--model", str(self.model_dir), "--port", str(self.port),
                    "--run-dir", self.run_dir, *redis,
                    "--heartbeat-s", "0.2", "--kv-cache-tokens", "20000", *self.extra]
            self.log = open(os.path.join(self.run_dir, "up.log"), "w")  # noqa: SIM115
            self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                         start_new_session=self.new_session)
            Stack.live.add(self)
            try:
                self.wait_healthy(timeout_s)
                return self
            except RuntimeError:
                if attempt == 2 or "(--port): Address already in use" not in self.logs():
                    self.stop()  # a fixture whose set-up fails is not torn down
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        return self

    def wait_healthy(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.get("/health")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("stack did not become healthy:\n" + self.logs())
            time.sleep(0.2)

    def logs(self, chars: int = 5000) -> str:
        try:
            return Path(self.run_dir, "up.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_for_log(self, text: str, timeout_s: float = 30) -> str:
        """The logs once they contain `text` (the banner comes a little after /health)."""
        deadline = time.monotonic() + timeout_s
        while text not in (logs := self.logs()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the logs:\n{logs}")
            time.sleep(0.1)
        return logs

    def pid(self, name: str) -> int:
        return int(Path(self.run_dir, f"{name}.pid").read_text())

    def get(self, path: str) -> tuple[int, dict | str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as r:
                return r.status, _body(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _body(e.read())
        except OSError:
            return 0, ""

    def post(self, path: str, payload: dict | bytes) -> tuple[int, dict | str]:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, _body(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _body(e.read())

    def engine_stats(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for line in str(text).splitlines():
            if line.startswith("pipellm_") and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        Stack.live.discard(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _body(raw: bytes) -> dict | str:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
