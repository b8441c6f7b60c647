"""`docker compose up` for real, where a Docker daemon is available (marked `docker`; skipped
without one): build, health, a streamed chat completion with the official client, the C++
kernels built into compute's image, compute killed and back, a fast stop, and `down` leaves
nothing. Timings go to stdout (-s to see them).

Building needs the base images compose.yaml and Dockerfile name (`python:3.11-slim`, `redis:7`;
../shared/recipes/docker-local.md makes them where no registry is reachable) and, for a
CPU-only compute image, a CPU torch wheel in ./wheels (this test copies the one pip resolves).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "pipellm-test"
PORT = 8000

pytestmark = pytest.mark.docker


def compose_cmd() -> list[str] | None:
    """`docker compose` (v2) or `docker-compose` (v1), whichever works with a live daemon."""
    if shutil.which("docker") is None:
        return None
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return None
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


COMPOSE = compose_cmd()
if COMPOSE is None:
    pytest.skip("no Docker daemon and compose here", allow_module_level=True)


def composer(project: str, file: str):
    """`compose(*args, timeout=, check=)`: a compose command on `file` as project `project`,
    its output; an AssertionError with it where the command fails and `check`."""
    def compose(*args: str, timeout: float = 1800, check: bool = True):
        argv = [*COMPOSE, "-p", project, "-f", str(ROOT / file), *args]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed:\n{out.stdout}\n{out.stderr}")
        return out

    return compose


compose = composer(PROJECT, "compose.yaml")


def healthy() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_until(ready, timeout_s: float, compose, period_s: float = 0.5) -> float:
    """Seconds until `ready()`; past `timeout_s` an AssertionError with the stack's last logs
    (`compose`: the file's compose command)."""
    start = time.monotonic()
    while not ready():
        assert time.monotonic() - start < timeout_s, compose("logs", "--tail", "40").stdout
        time.sleep(period_s)
    return time.monotonic() - start


def wait_healthy(timeout_s: float) -> float:
    return wait_until(healthy, timeout_s, compose)


def container(service: str) -> str:
    return compose("ps", "-q", service).stdout.strip()


def cpu_torch_wheel() -> None:
    """./wheels/torch-*.whl as pip resolves it here (the CPU build on these machines)."""
    wheels = ROOT / "wheels"
    if any(wheels.glob("torch-*.whl")):
        return
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                    str(wheels), "torch==2.13.0"], check=True, timeout=600)


def built_and_up(compose, ready) -> Iterator[dict]:
    """Build, `up -d`, wait for `ready()` (its seconds); yield the timings, print them at the
    end and bring everything down (a module fixture's body, for any compose file)."""
    cpu_torch_wheel()
    times = {}
    t = time.monotonic()
    compose("build")
    times["build_s"] = time.monotonic() - t
    t = time.monotonic()
    compose("up", "-d")
    times["up_s"] = time.monotonic() - t
    times["ready_after_s"] = ready()
    yield times
    print(json.dumps(times))
    compose("down", "-v", "--remove-orphans", check=False)


@pytest.fixture(scope="module")
def stack():
    yield from built_and_up(compose, lambda: wait_healthy(600))


def test_health_and_a_streamed_chat_completion(stack):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and text.strip()
    print(json.dumps({"answer": text}))


def test_compute_loads_the_kernels_built_into_its_image(stack):
    """The C++ CPU kernels were compiled when the image was built: compute loads them at
    start-up (neither compiles them for minutes nor falls back to the PyTorch reference)."""
    log = compose("logs", "--no-color", "compute").stdout
    assert "C++ CPU kernels loaded (cached)" in log, log[-3000:]


def test_killed_compute_comes_back(stack):
    cid = container("compute")
    # the compute process crashes (not a `docker kill`, which Docker counts as a manual stop)
    subprocess.run(["docker", "exec", cid, "python", "-c",
                    "import os, signal\n"
                    "for p in os.listdir('/proc'):\n"
                    "    if p.isdigit() and b'service\\x00compute' in open(f'/proc/{p}/cmdline', "
                    "'rb').read(): os.kill(int(p), signal.SIGKILL)"], check=False)
    t = time.monotonic()
    while healthy() and time.monotonic() - t < 30:  # the gateway notices the missing heartbeat
        time.sleep(0.2)
    back = wait_healthy(300)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=client.models.list().data[0].id, prompt="Hello",
                                  max_tokens=4)
    assert r.choices[0].text is not None
    stack["compute_back_after_s"] = back


def test_stop_is_fast_and_down_leaves_nothing(stack):
    t = time.monotonic()
    compose("stop")
    stack["stop_s"] = time.monotonic() - t
    assert stack["stop_s"] < 10, stack  # SIGTERM reaches every process (init: true)
    compose("down", "-v", "--remove-orphans")
    left = subprocess.run(["docker", "ps", "-aq", "--filter",
                           f"label=com.docker.compose.project={PROJECT}"],
                          capture_output=True, text=True).stdout.split()
    nets = subprocess.run(["docker", "network", "ls", "-q", "--filter", f"name={PROJECT}"],
                          capture_output=True, text=True).stdout.split()
    assert left == [] and nets == []
    sizes = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}"],
                           capture_output=True, text=True).stdout
    stack["images"] = [line for line in sizes.splitlines() if line.startswith("pipellm")]
