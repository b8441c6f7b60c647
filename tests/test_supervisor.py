"""`pipellm up` as a user runs it: embedded Redis, all services, and Ctrl-C leaves nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pipellm.shared import demo_model as dm
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
    stack = Stack(demo_model_dir, embedded_redis=True)
    run_dir = stack.run_dir
    argv = [sys.executable, "-m", "pipellm.services.cli", "serve", str(demo_model_dir),
            "--port", str(stack.port), "--run-dir", run_dir, "--tokenizer-workers", "2",
            "--kv-cache-tokens", "1000", "--dtype", "float32", "--device", "cpu"]
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
        # what a user needs at start-up: the URL, dtype and device, the KV cache's size
        banner = log.read_text()
        assert f"http://127.0.0.1:{stack.port}/v1" in banner
        assert "float32 on cpu" in banner and "context 2048 tokens" in banner
        # K and V in fp16: a float32 model's cache on the CPU kernels (kv/element.py)
        per_token = dm.LAYERS * 2 * dm.KV_HEADS * (dm.HIDDEN // dm.HEADS) * 2
        kv_gib = 1000 * per_token / 2**30
        assert f"KV cache: 1000 tokens, {round(kv_gib, 3)} GiB (float16)" in banner
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
        stack.stop()


def start_up(model_dir, run_dir: str, port: int, *extra: str) -> tuple[subprocess.Popen, Path]:
    """`pipellm up` with its embedded Redis; returns (process, log file) once it is up."""
    argv = [sys.executable, "-m", "pipellm.services.cli", "up", "--model", str(model_dir), "--port",
            str(port), "--run-dir", run_dir, "--heartbeat-s", "0.2", *extra]
    log = Path(run_dir, "out.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while "pipellm is up" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()  # the caller gets no process to stop
            proc.wait()
            raise AssertionError(log.read_text())
        time.sleep(0.2)
    return proc, log


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Seconds until predicate() held; fails after timeout_s."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, what
        time.sleep(0.1)
    return time.monotonic() - start


def test_port_taken_refuses_to_start_in_one_line(demo_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "up", "--model",
                              str(demo_model_dir), "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "pipellm is up" not in out.stdout
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0], errors
    assert time.monotonic() - start < 30  # nothing was started and waited for


def test_killed_embedded_redis_comes_back_with_its_data(demo_model_dir):
    import redis

    stack = Stack(demo_model_dir, embedded_redis=True)
    run_dir = stack.run_dir
    try:
        stack.proc, log = start_up(demo_model_dir, run_dir, stack.port)
        url = next(line.split()[-4] for line in log.read_text().splitlines()
                   if "embedded redis at" in line)
        client = redis.Redis.from_url(url)
        client.set("pipellm-test-key", "kept")
        time.sleep(1.5)  # the append-only file is synced every second
        os.kill(int(Path(run_dir, "redis.pid").read_text()), signal.SIGKILL)
        assert wait_for(lambda: stack.get("/health")[0] != 200, 10, "health never noticed")
        recovery = wait_for(lambda: stack.get("/health")[0] == 200, 30, "redis not restarted")
        assert client.get("pipellm-test-key") == b"kept"
        code, body = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert code == 200, body
        assert "redis exited with code -9" in log.read_text() and recovery < 30
        assert "tools: described in the system message" in log.read_text()  # the banner
    finally:
        stack.stop()


def test_crash_loop_backs_off_and_reports_the_last_error(demo_model_dir):
    """compute's tcp address taken while it restarts: each crash is reported with the bind error
    and the delays double; once the address is free, compute comes back."""
    from pipellm.shared.redis_server import free_port

    stack = Stack(demo_model_dir, embedded_redis=True)
    run_dir = stack.run_dir
    addr_port = free_port()
    try:
        stack.proc, log = start_up(demo_model_dir, run_dir, stack.port, "--compute-addr",
                                   f"tcp://127.0.0.1:{addr_port}")
        blocker = socket.socket()
        os.kill(int(Path(run_dir, "compute.pid").read_text()), signal.SIGKILL)
        wait_for(lambda: _try_bind(blocker, addr_port), 10, "compute's port never freed")
        wait_for(lambda: "restart 2 in 2 s" in log.read_text(), 30, log.read_text()[-3000:])
        crashes = [line for line in log.read_text().splitlines() if "compute exited" in line]
        assert "restart 1 in 1 s" in crashes[0], crashes  # the kill; then the doubled delay
        assert "Address already in use" in crashes[-1], crashes
        blocker.close()
        wait_for(lambda: stack.get("/health")[0] == 200, 30, "compute did not come back")
        code, body = stack.post("/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert code == 200, body
    finally:
        stack.stop()


def _try_bind(sock, port: int) -> bool:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq binds
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        return True
    except OSError:
        return False


def test_each_compute_rank_gets_its_device_and_share_of_cores(monkeypatch):
    """--data-parallel-size N: rank r takes the r-th visible GPU (ranks wrap around when there
    are fewer, sharing one), and on a CPU without --threads, cores / N threads."""
    from pipellm.services.supervisor import compute_env
    from pipellm.shared.config import EngineConfig

    engine = EngineConfig(model="unused")
    assert compute_env(engine, 1, 0) == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [compute_env(engine, 3, r)["CUDA_VISIBLE_DEVICES"] for r in range(3)] == \
        ["3", "5", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    env = compute_env(engine, 4, 2)
    assert env == {"PIPELLM_DATA_PARALLEL_RANK": "2", "CUDA_VISIBLE_DEVICES": "2",
                   "PIPELLM_THREADS": "4"}
    assert "PIPELLM_THREADS" not in compute_env(EngineConfig(model="unused", threads=2), 4, 2)


def test_the_error_reported_is_the_traceback_s_not_the_noise_after_it():
    from pipellm.services.supervisor import Child

    child = Child("compute", [], {})
    child.stderr_tail.extend([
        "2026-11-28 INFO pipellm.compute: starting\n", "Traceback (most recent call last):\n",
        '  File "x.py", line 1, in <module>\n', "    bind()\n",
        "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5')\n",
        "nanobind: leaked 4 instances!\n", " - leaked instance 0x7f of type \"ir.attribute\"\n",
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html\n"])
    assert child.last_error().startswith("zmq.error.ZMQError: Address already in use")
    child.stderr_tail.clear()
    child.stderr_tail.extend(["a line\n", "killed\n", "\n"])
    assert child.last_error() == "killed"
