"""Sliding-window attention against transformers on tiny random models (3 layers, 4 heads over
2 KV heads, float32, window 16): greedy tokens through the engine with chunked prefill (chunks
smaller than the window, starting mid-window), mixed batches, preemption, prefix caching and an
INT8 KV cache; logprobs; the Triton kernels under the interpreter; a GGUF file.

Variants: mistral (sliding_window on every layer), qwen2 (use_sliding_window with
max_window_layers 1: layer 0 full, layers 1-2 slide). Prompts of 40-120 tokens and 40 new
tokens, so both prefill and decode reach far past the window.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from pipellm.services.compute.backend import served_model
from pipellm.shared.config import EngineConfig
from pipellm.shared.model_config import ModelConfig
from tests.gguf_files import Q, write_gguf
from tests.hf_models import build_hf_model
from tests.test_architectures import (
    TINY,
    check_int8_kv_per_step,
    check_prefix_caching,
    engine,
    greedy,
)
from tests.test_engine_vs_hf import engine_greedy, hf_greedy
from tests.test_logprobs import hf_logprobs

WINDOW = 16
NEW = 40
VARIANTS = {  # name: (ARCHES key, config overrides)
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                        "max_window_layers": 1}),
}
LAYER_WINDOWS = {"mistral": (WINDOW,) * 3, "qwen2": (0, WINDOW, WINDOW)}


def prompts_40_to_120(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (40, 57, 73, 90, 105, 120)]


def without_window(model):
    """The same weights in a model of the same class without any window (full attention)."""
    cfg = copy.deepcopy(model.config)
    cfg.sliding_window = None
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    full = type(model)(cfg).eval()
    full.load_state_dict(model.state_dict())
    return full


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
    """(name, model dir, HF model, prompts, HF's greedy continuations)."""
    arch, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param) / "hf"
    model = build_hf_model(path, arch, **TINY, **overrides)
    prompts = prompts_40_to_120()
    return request.param, path, model, prompts, hf_greedy(model, prompts, NEW)


def test_config_reads_each_layers_window_and_serves_the_full_context(reference):
    name, path, model, _, _ = reference
    mc = ModelConfig.from_path(path)
    assert mc.sliding_window == WINDOW
    assert tuple(mc.layer_window(i) for i in range(mc.num_layers)) == LAYER_WINDOWS[name]
    assert mc.layer_types == (None if name == "mistral" else
                              ("full_attention", "sliding_attention", "sliding_attention"))
    config = EngineConfig(model=str(path), device="cpu", dtype="float32")
    assert served_model(config)[1] == model.config.max_position_embeddings == 1024


def test_transformers_applies_the_window(reference):
    """The reference is a real one: without its window the same weights continue otherwise."""
    _, _, model, prompts, expected = reference
    assert hf_greedy(without_window(model), prompts, NEW) != expected


def test_chunked_prefill_and_mixed_batches_match_hf(reference):
    """12 tokens a step beside up to 8 decodes: prefill chunks of 4-12 tokens start anywhere in
    the window, and share steps with other requests' decodes."""
    _, path, _, prompts, expected = reference
    got, eng = engine_greedy(path, prompts, NEW, max_batched_tokens=12, max_running=8,
                             kv_cache_tokens=4096)
    assert got == expected
    assert eng.stats().reserved == 0


def test_preemption_matches_hf(reference):
    _, path, _, prompts, expected = reference
    got, eng = engine_greedy(path, prompts, NEW, max_batched_tokens=32, max_running=8,
                             kv_cache_tokens=360, default_predicted_len=2, kv_min_grow=4)
    assert eng.stats().preemptions > 0
    assert got == expected


def test_prefix_caching_matches_hf(reference):
    """A cached 50-token prefix (over three windows): the suffixes' chunks attend into it."""
    check_prefix_caching(reference, 50, (3, 9, 1, 17, 30), NEW, max_batched_tokens=12)


def test_int8_kv_cache_stays_close_to_hf(reference):
    """At every one of the 40 steps (tests/test_architectures.py's per-step rule)."""
    check_int8_kv_per_step(reference, reference[3], NEW, max_batched_tokens=12, max_running=8)


def test_logprobs_match_hf_log_softmax(reference):
    """Prompt and output logprobs within 1e-3 of transformers' on the whole sequence."""
    _, path, model, prompts, _ = reference
    prompts = prompts[::2]
    seqs = engine(path, max_batched_tokens=12, max_running=8, kv_cache_tokens=4096).generate(
        prompts, greedy(NEW, logprobs=True, prompt_logprobs=0))
    for seq, prompt in zip(seqs, prompts, strict=True):
        ref = hf_logprobs(model, seq.token_ids)  # [prompt + output, vocab]
        P = len(prompt)
        want = ref[torch.arange(P - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(torch.tensor(seq.prompt_logprobs), want, atol=1e-3, rtol=0)
        rows = ref[P - 1:P - 1 + len(seq.output_ids)]
        assert seq.output_ids == rows.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(seq.logprobs), rows.max(-1).values, atol=1e-3,
                                   rtol=0)


def test_triton_kernels_through_the_engine_match_hf(tmp_path):
    """The GPU path (Triton, here under its CPU interpreter) with a window: chunked prefill
    past the window and decodes past it, token-exact with transformers. Mistral's window on
    every layer (layers that differ: Gemma 3's, in tests/test_architectures.py)."""
    from pipellm.kernels.dispatch import set_backend

    arch, overrides = VARIANTS["mistral"]
    model = build_hf_model(tmp_path, arch, **TINY, **overrides)
    path, prompts = tmp_path, prompts_40_to_120()
    prompts = [prompts[0][:35], prompts[1][:20]]
    try:
        eng = engine(path, max_batched_tokens=12, max_running=4, kv_cache_tokens=512,
                     kernels="triton")
        got = [s.output_ids for s in eng.generate(prompts, greedy(24))]
    finally:
        set_backend("auto")
    assert got == hf_greedy(model, prompts, 24)


def test_mistral_gguf_with_a_window_generates_what_transformers_does(tmp_path):
    """llama.cpp stores Mistral as the `llama` architecture with
    `llama.attention.sliding_window`: read back as Mistral with the window, same config and
    same tokens as the HF directory."""
    path = tmp_path / "hf"
    model = build_hf_model(path, "mistral", **TINY, sliding_window=WINDOW)
    gguf = write_gguf(tmp_path / "mistral.gguf", model, Q.F32, arch="llama")
    assert ModelConfig.from_path(gguf) == ModelConfig.from_path(path)
    prompts = prompts_40_to_120(seed=3)[::2]
    seqs = engine(gguf, max_batched_tokens=12, max_running=8,
                  kv_cache_tokens=2048).generate(prompts, greedy(NEW))
    assert [s.output_ids for s in seqs] == hf_greedy(model, prompts, NEW)
