"""`pipellm up` as a user runs it: embedded Redis, all services, and Ctrl-C leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.stack import Stack


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_up_with_embedded_redis_and_ctrl_c_leaves_no_orphans(demo_model_dir):
    run_dir = tempfile.mkdtemp(prefix="pl-")
    stack = Stack(demo_model_dir)
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(demo_model_dir),
            "--port", str(stack.port), "--run-dir", run_dir, "--tokenizer-workers", "2"]
    log = Path(run_dir, "out.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True)
    stack.proc = proc
    try:
        deadline = time.monotonic() + 120  # the supervisor announces once /health is green
        while "pipellm is up" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        code, body = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert code == 200, body
        names = ["redis", "compute", "detokenizer", "tokenizer-0", "tokenizer-1", "gateway"]
        pids = {n: int(Path(run_dir, f"{n}.pid").read_text()) for n in names}
        assert all(alive(p) for p in pids.values())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [n for n, p in pids.items() if alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
