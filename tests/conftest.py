"""Shared fixtures: the demo checkpoint and a factory for tiny Hugging Face reference models."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run under the interpreter (on CPU tensors). The variable must be
# set before any kernel module is imported, i.e. here, before the tests import anything.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from pipellm.shared.demo_model import ensure_demo_model
from tests.hf_models import build_hf_model

TOOLS_MODEL = "smol"  # the served name of `tools_stack`'s model


@pytest.fixture(scope="module")
def redis_url():
    """A real Redis (redis-server in a temporary directory) for one test module."""
    from pipellm.shared.redis_server import EmbeddedRedis

    with EmbeddedRedis() as r:
        yield r.url


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo Llama checkpoint, built once per test session in a temporary directory."""
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "demo-llama")


@pytest.fixture(scope="session")
def tools_stack():
    """One real server on the default model (SmolLM2) with the built-in tool-capable template,
    auto tool choice (hermes) and qwen3's reasoning parser, shared by the end-to-end tests of
    the chat, Messages and Responses APIs (tests/test_tools_e2e.py, test_responses_e2e.py).
    A test that kills its services waits until it is healthy again."""
    from pipellm.shared import default_model
    from tests.stack import Stack

    s = Stack(default_model.fetch(), "--kv-cache-tokens", "8192", "--served-model-name",
              TOOLS_MODEL, "--chat-template", "chatml_tools", "--enable-auto-tool-choice",
              "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    s.start(timeout_s=300)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def kv_engines(demo_model_dir):
    """`make(kv_cache_dtype, **settings)`: an engine on the demo checkpoint, float32 unless
    `settings` names a dtype (tests/test_kv_int8.py, test_kv_fp8.py, test_kv_fp16.py)."""
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.settings import with_settings

    def make(kv_cache_dtype, **settings):
        settings = {"dtype": "float32", **settings}
        return build_engine(with_settings(EngineConfig(), model=str(demo_model_dir),
                                          device="cpu", kv_cache_dtype=kv_cache_dtype,
                                          **settings))
    return make


@pytest.fixture(scope="session")
def smollm2_hf():
    """(transformers model, tokenizer), both loaded by transformers from the reference GGUF
    (SmolLM2, float32): once a session, as the load takes 40 s on a slow CPU
    (tests/test_smollm2.py, test_lora_smollm2.py)."""
    import torch
    import transformers

    from pipellm.shared import default_model

    path = default_model.fetch()
    kw = {"gguf_file": path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **kw).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, **kw)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test's report ends with the last logs of every stack still up (tests/stack.py):
    what each service said, and the engine's last stats lines (running, waiting)."""
    from tests.stack import Stack

    report = (yield).get_result()
    if report.failed and report.when == "call":
        for s in Stack.live:
            report.sections.append((f"pipellm stack {s.url} (up.log)", s.logs(20000)))


@pytest.fixture
def hf_model_factory(tmp_path: Path) -> Callable[..., tuple[Path, object]]:
    """`make(arch="llama", **kw) -> (model_dir, hf_model)`; kw as for `build_hf_model`."""
    counter = itertools.count()

    def make(arch: str = "llama", **kwargs) -> tuple[Path, object]:
        path = tmp_path / f"{arch}-{next(counter)}"
        return path, build_hf_model(path, arch, **kwargs)

    return make


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip (visibly, with the reason) where CUDA is not available."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def interpreter_bf16_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton interpreter stores bf16 as uint16 and its tl.dot multiplies the bit patterns
    (triton-lang/triton#11584, "not supported yet"): upcast bf16 dot operands to fp32 there."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    orig = interpreter.InterpreterBuilder.create_dot

    def to_f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        data = (h.data.astype(np.uint32) << 16).view(np.float32)  # bf16 bits -> fp32 value
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, *args):
        return orig(self, to_f32(a), to_f32(b), d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(params=["avx2", "avx2_vnni", "avx512", "avx512_vnni"])
def block_gemm_level(request: pytest.FixtureRequest) -> str:
    """Each variant of the C++ block GEMMs (pipellm/kernels/cpu/isa.py's VARIANTS) this CPU runs,
    switched on in process for the test (so the AVX2 kernel is tested on any x86 machine); the
    CPU's choice restored afterwards. Skipped, naming why, where the CPU lacks the variant or the
    extension has no block GEMMs."""
    from pipellm.kernels.cpu import extension, isa

    ext = extension()
    if ext is None or not ext.block_gemm_isa():
        pytest.skip("the C++ block GEMMs do not run here (python -m pipellm.kernels.cpu says why)")
    if request.param not in isa.variants():
        pytest.skip(f"this CPU does not run {request.param} ({isa.describe()})")
    previous = ext.block_gemm_isa()
    ext.set_block_gemm_isa(request.param)
    yield request.param
    ext.set_block_gemm_isa(previous)
