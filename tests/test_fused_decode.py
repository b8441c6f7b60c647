"""A decode step's layers in one C++ call (pipellm/services/compute/model/fused_decode.py,
pipellm/kernels/cpu/decode_layers.cpp) against LlamaModel's layer loop, its reference: the logits of
every step bit-identical, greedy and sampled, over tiny random models of each kind it takes
(Llama, Qwen2's qkv bias, Mistral's window, Phi-3's partial rotary, Qwen3's q/k norms; fp16,
float32 and INT8 caches) and SmolLM2's Q4_1 GGUF; the steps it leaves to the loop (prefills,
FP8 caches; LoRA rows: tests/test_lora.py) and the models (sandwich norms, float projections)."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.services.compute.backend import build_engine
from pipellm.shared.config import EngineConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.hf_models import build_hf_model

pytestmark = pytest.mark.skipif(dispatch.block_gemm_extension(torch.zeros(1)) is None,
                                reason="needs the C++ CPU kernels' block GEMMs (x86, AVX2)")
TINY = dict(initializer_range=0.1, num_hidden_layers=3, with_tokenizer=True)
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)]


def make_engine(model, **settings):
    settings = {"quantization": "int4", "dtype": "float32", **settings}
    return build_engine(with_settings(EngineConfig(), model=str(model), device="cpu",
                                      kv_cache_tokens=1024, **settings))


def steps(engine, fused) -> list[tuple[bool, torch.Tensor]]:
    """(whether the fused call took it, its logits) of each step of the same requests, with
    the model's fused layers set to `fused` (None: the loop)."""
    model, seen = engine.runner.model, []
    model.fused = fused
    forward = type(model).forward_hidden

    def record(batch, kv):
        took = fused is not None and fused.takes(batch, kv)
        logits, hidden = forward(model, batch, kv)
        seen.append((took, logits.clone()))
        return logits, hidden

    model.forward_hidden = record
    try:
        vocab = engine.model_config.vocab_size
        prompts = [[(5 + 7 * i + 31 * j) % vocab for i in range(9 + 13 * j)] for j in range(3)]
        engine.generate(prompts, PARAMS[:1] * 2 + PARAMS[1:])
    finally:
        del model.forward_hidden
        model.fused = fused
    return seen


def assert_same_as_the_loop(engine) -> None:
    fused = engine.runner.model.fused
    assert fused is not None
    with_fused, loop = steps(engine, fused), steps(engine, None)
    assert len(with_fused) == len(loop) and sum(took for took, _ in with_fused) >= 10
    assert not all(took for took, _ in with_fused)  # the prefills ran the loop
    for (_, a), (_, b) in zip(with_fused, loop, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch, overrides, settings", [
    ("llama", {}, {}),  # the fp16 cache (auto) under float32
    ("llama", {}, {"kv_cache_dtype": "float32"}),
    ("llama", {}, {"kv_cache_dtype": "int8"}),
    ("qwen2", {}, {}),  # qkv bias, tied embeddings
    ("mistral", {"sliding_window": 8}, {}),  # the window on every layer
    ("phi3", {"partial_rotary_factor": 0.5}, {}),  # half the head rotated
    ("qwen3", {}, {}),  # q/k norms, head_dim 32 != hidden / heads
], ids=["llama", "llama-f32-cache", "llama-int8-cache", "qwen2", "mistral-window",
        "phi3-partial", "qwen3"])
def test_fused_steps_are_the_loops_bit_for_bit(tmp_path, arch, overrides, settings):
    build_hf_model(tmp_path, arch, **TINY, **overrides)
    assert_same_as_the_loop(make_engine(tmp_path, **settings))


def test_smollm2_gguf_steps_are_the_loops():
    """The default model as served (its INT4 blocks): the warm-up's line in the banner says
    its decode steps run fused."""
    from pipellm.services.compute.warmup import warm_up
    from pipellm.shared import default_model

    engine = make_engine(default_model.fetch(), quantization="auto")
    assert "decode steps' layers in one C++ call" in warm_up(engine)
    assert_same_as_the_loop(engine)


def test_what_it_leaves_to_the_loop(tmp_path, demo_model_dir):
    from pipellm.services.compute.warmup import warm_up

    build_hf_model(tmp_path / "llama", "llama", **TINY)
    engine = make_engine(tmp_path / "llama", kv_cache_dtype="fp8")
    fused = engine.runner.model.fused
    assert fused is not None and not any(took for took, _ in steps(engine, fused))
    build_hf_model(tmp_path / "gemma2", "gemma2", **TINY)  # sandwich norms, GELU, soft-caps
    assert make_engine(tmp_path / "gemma2").runner.model.fused is None
    engine = make_engine(demo_model_dir, quantization="none")
    assert engine.runner.model.fused is None and "C++ call" not in warm_up(engine)
