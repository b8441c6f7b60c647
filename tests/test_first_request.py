"""Issue 32: nothing is compiled on a request. Compute builds the C++ CPU kernels, warms the
model up and loads the grammar compiler (xgrammar) before it reports ready, so the first
request after /health is green, and the first with a grammar, are as fast as the ones after
them, even on an extension cache without the built library; the warm-up leaves the engine as
it was."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.warmup import warm_up
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.sampling import SamplingParams
from tests.stack import Stack

CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}
JSON = {**CHAT, "response_format": {"type": "json_object"}}
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                    reason="needs a C++ compiler (scripts/setup.sh's build)")


def _timed(stack: Stack, body: dict = CHAT) -> float:
    start = time.monotonic()
    status, body = stack.post("/v1/chat/completions", body)
    assert status == 200, body
    return time.monotonic() - start


def seed_objects(ext) -> None:
    """Copy the object files of setup.sh's build (the default extension cache) into `ext`,
    without the library: the server's build there links them (ninja keeps objects whose
    command is unchanged, so a build from this checkout costs seconds instead of ~2 min of
    compiling; from another one, it compiles all)."""
    from torch.utils.cpp_extension import _get_build_directory

    default = Path(_get_build_directory("pipellm_cpu_kernels", verbose=False))
    if not (default / "build.ninja").exists():
        return  # nothing built yet: the server compiles everything
    shutil.copytree(default, ext / "pipellm_cpu_kernels",
                    ignore=shutil.ignore_patterns("*.so", "lock"))


@pytest.mark.slow  # a kernel build, on purpose (runs in CI: nothing deselects `slow`)
@needs_compiler
def test_first_request_after_health_is_fast_without_built_kernels(demo_model_dir, tmp_path,
                                                                  monkeypatch):
    ext = tmp_path / "torch_extensions"
    seed_objects(ext)
    assert not list(ext.glob("*/*.so"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))  # the server's: no library built
    start = time.monotonic()
    stack = Stack(demo_model_dir).start(timeout_s=600)  # the build comes first
    try:
        healthy_after = time.monotonic() - start
        built = list(ext.glob("*/*.so"))
        assert built, "/health went green before the C++ CPU kernels were built"
        assert "C++ CPU kernels compiled" in stack.logs()
        first, second, json_first = _timed(stack), _timed(stack), _timed(stack, JSON)
        print(f"healthy after {healthy_after:.1f} s; first request {first:.2f} s, "
              f"second {second:.2f} s, first with a grammar {json_first:.2f} s")
        assert first < 5.0 and first < 5 * second + 1.0, (first, second)
        assert json_first < 5 * second + 1.0, (json_first, second)
        banner = stack.wait_for_log("compute: C++ CPU kernels built in")
        assert "; warm-up " in banner
    finally:
        stack.stop()
    # what scripts/setup.sh runs: on the cache the server filled, a load
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    out = subprocess.run([sys.executable, "-m", "pipellm.kernels.cpu"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "C++ CPU kernels loaded (cached)" in out.stdout, out
    assert str(built[0]) in out.stdout


@needs_compiler
def test_a_stale_build_lock_is_taken_over(tmp_path):
    """A build killed midway leaves torch's lock file, on which the next build would wait
    forever: it is removed, with a warning, and the build completes."""
    ext = tmp_path / "torch_extensions"
    seed_objects(ext)
    (ext / "pipellm_cpu_kernels").mkdir(parents=True, exist_ok=True)
    (ext / "pipellm_cpu_kernels" / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    out = subprocess.run([sys.executable, "-m", "pipellm.kernels.cpu"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "C++ CPU kernels built" in out.stdout, out
    assert "removed a stale build lock" in out.stderr, out.stderr
    assert not (ext / "pipellm_cpu_kernels" / "lock").exists()


def test_a_failed_kernel_build_does_not_fail_setup(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/nonexistent/c++"}
    out = subprocess.run([sys.executable, "-m", "pipellm.kernels.cpu"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out
    assert "C++ CPU kernels unavailable" in out.stdout and "not found" in out.stdout
    assert "PyTorch reference" in out.stdout


def test_a_long_build_says_it_is_still_building(caplog):
    """Nothing waits without saying why: a build that runs on is reported while it runs, and
    the reports stop when it ends."""
    from pipellm.kernels import cpu

    with caplog.at_level("INFO", logger="pipellm.kernels.cpu"):
        with cpu._still_building(period_s=0.05):
            time.sleep(0.3)
        reports = len(caplog.records)
        time.sleep(0.2)
    assert reports >= 3 and len(caplog.records) == reports
    assert "still building the C++ CPU kernels" in caplog.records[0].getMessage()


def test_no_kernel_source_includes_torch_extension():
    """A first build compiles each source once: the kernel sources include the ATen they use
    (kernels/cpu/tensor.h), and the two Python modules' bindings torch's pybind11 headers, not
    <torch/extension.h> (torch's whole C++ frontend), whose parse was most of a source's
    compile (bench/kernel_build.py)."""
    from pipellm.kernels import cpu

    folder = Path(cpu.__file__).parent
    torch_includes = {p.name: re.findall(r"^#include <(torch/[^>]+)>", p.read_text(), re.M)
                      for p in folder.iterdir() if p.suffix in (".cpp", ".h")}
    assert {name: inc for name, inc in torch_includes.items() if inc} == {
        "amx_emulated.cpp": ["torch/csrc/utils/pybind.h"],
        "bindings.cpp": ["torch/csrc/utils/pybind.h"]}
    assert all(p.name == "bindings.cpp" or "PYBIND11_MODULE" not in p.read_text()
               for p in cpu._SOURCES)


def test_warm_up_leaves_the_engine_as_it_was(demo_model_dir):
    config = EngineConfig(model=str(demo_model_dir), device="cpu", kv_cache_tokens=512,
                          scheduler=SchedulerConfig(enable_prefix_caching=True),
                          hidden_length=True)
    engine, fresh = build_engine(config), build_engine(config)
    before = engine.stats()
    said = warm_up(engine)
    assert "C++ CPU kernels" in said and "warm-up" in said
    assert engine.stats() == before and not engine.requests and not engine.has_work()
    assert engine.lengths.learned == 0 and not engine.lengths.checkpoints
    assert engine.kv.prefix_cache.slots == 0
    # what the warm-up left in the KV slots is never read: the same greedy output as without it
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 9, 200], list(range(3, 60))]
    assert [s.output_ids for s in engine.generate(prompts, greedy)] == \
        [s.output_ids for s in fresh.generate(prompts, greedy)]


def test_sim_backend_has_nothing_to_warm():
    from pipellm.services.compute.backend import build_engine

    engine = build_engine(EngineConfig(backend="sim"))
    assert engine.runner.simulated and warm_up(engine) == ""
