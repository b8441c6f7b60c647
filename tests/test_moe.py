"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) against transformers on tiny random models
(3 layers, 4 heads over 2 KV heads, 8 experts top-2, float32): greedy tokens through the engine
(chunked prefill, mixed batches, preemption, prefix caching, an INT8 KV cache), logprobs, GGUF
files, the three expert paths (per-expert reference, CPU grouped, fused Triton kernel under
the interpreter), the quantization methods on experts, and the configs we refuse.

Variants: qwen3_moe (q/k RMSNorm per head; layer 1 a dense MLP through mlp_only_layers; the
top-2 weights not renormalized), mixtral (renormalized top-2; the GGUF `llama` with experts),
olmoe (q/k RMSNorm over the whole projection).
"""

from __future__ import annotations

import json

import pytest
import torch

from pipellm.kernels.dispatch import set_backend
from pipellm.kernels.fused_moe import fused_moe_ref
from pipellm.services.compute.model.moe import MoE, experts_grouped, experts_loop, route
from pipellm.services.compute.model.quantization import Quantization, resolve
from pipellm.services.compute.model.weights import load_weights
from pipellm.shared.model_config import ModelConfig, ModelLoadError
from tests.gguf_files import Q, write_gguf
from tests.hf_models import build_hf_model
from tests.test_architectures import (  # noqa: F401  (the engine tests run here on MoE models)
    TINY,
    build_reference,
    engine,
    greedy,
    test_chunked_prefill_and_mixed_batches_match_hf,
    test_logprobs_match_hf_log_softmax,
    test_preemption_matches_hf,
    test_prefix_caching_matches_hf,
)
from tests.test_engine_vs_hf import MAX_NEW, hf_greedy, make_prompts
from tests.test_logprobs import hf_logprobs
from tests.test_quantization import TOLERANCE, _engine, _perplexity

VARIANTS = {  # name: (ARCHES key, config overrides)
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
    """What the engine tests imported from tests/test_architectures.py take."""
    return build_reference(request.param, VARIANTS, tmp_path_factory)


def test_config_reads_the_experts(reference):
    name, path, model, _, _ = reference
    cfg = ModelConfig.from_path(path)
    assert cfg.architecture == type(model).__name__
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 64)
    assert cfg.moe_layers == ((0, 2) if name == "qwen3_moe" else (0, 1, 2))
    assert cfg.norm_topk_prob == (name == "mixtral")
    assert cfg.qk_norm == (name == "qwen3_moe") and cfg.qk_norm_full == (name == "olmoe")
    assert cfg.sliding_window is None


def test_int8_kv_cache_stays_close_to_hf(reference):
    """tests/test_kv_int8.py's rule (most greedy tokens the same; the first token's logprob,
    prompt K/V quantized, within 0.05) with one allowance: the router's renormalized softmax
    carries the K/V rounding through one more nonlinearity, so one prompt of eight may be off by
    up to 0.1 (Mixtral's worst here: 0.059, the same experts chosen as from the float cache)."""
    _, path, model, prompts, expected = reference
    prompts, expected = prompts[::2], expected[::2]
    seqs = engine(path, kv_cache_dtype="int8", max_batched_tokens=48, max_running=16,
                  kv_cache_tokens=4096).generate(prompts, greedy(MAX_NEW, logprobs=True))
    same = sum(a == b for s, e in zip(seqs, expected, strict=True)
               for a, b in zip(s.output_ids, e, strict=True))
    assert same / (MAX_NEW * len(prompts)) > 0.8
    first = [hf_logprobs(model, p)[-1].max().item() for p in prompts]
    errors = sorted(abs(s.logprobs[0] - f) for s, f in zip(seqs, first, strict=True))
    assert errors[-2] < 0.05 and errors[-1] < 0.1, errors


# --- the three expert paths -----------------------------------------------------------------


def _moe_layer(path, layer: int = 0, quant: Quantization | None = None) -> MoE:
    cfg = ModelConfig.from_path(path)
    return MoE(cfg, load_weights(path, torch.float32), layer, quant or Quantization())


def test_grouped_path_equals_the_per_expert_reference(reference):
    """The CPU path (tokens sorted by expert, a GEMM per expert) against transformers' loop
    and the kernel module's reference on the stacked weights."""
    _, path, model, _, _ = reference
    moe = _moe_layer(path, 2)
    x = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = route(x, moe.router, moe.top_k, moe.renormalize)
    assert len(set(ids.flatten().tolist())) == 8  # every expert has tokens
    grouped = experts_grouped(x, weights, ids, moe.experts)
    torch.testing.assert_close(grouped, experts_loop(x, weights, ids, moe.experts),
                               atol=1e-6, rtol=1e-5)
    hf_block = model.model.layers[2].mlp
    with torch.no_grad():
        torch.testing.assert_close(grouped, hf_block(x[None])[0], atol=1e-5, rtol=1e-5)
        w13 = hf_block.experts.gate_up_proj
        torch.testing.assert_close(grouped, fused_moe_ref(x, w13, hf_block.experts.down_proj,
                                                          weights, ids), atol=1e-5, rtol=1e-5)


def test_blocks_of_experts_sum_to_the_whole_layer(reference):
    """An expert-parallel rank's layer (`experts`: its block) routes over all 8 and returns its
    experts' share: the two halves' outputs, each nonzero, add up to the whole layer's, on
    both CPU paths."""
    _, path, model, _, _ = reference
    cfg, weights = ModelConfig.from_path(path), load_weights(path, torch.float32)
    whole, halves = MoE(cfg, weights, 0, Quantization()), \
        [MoE(cfg, weights, 0, Quantization(), range(e, e + 4)) for e in (0, 4)]
    assert [len(h.experts) for h in halves] == [4, 4] and whole.held is None
    x = torch.randn(30, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    for kernels in ("auto", "reference"):
        set_backend(kernels)
        try:
            parts = [h(x) for h in halves]
            assert all(p.abs().amax() > 0 for p in parts)
            torch.testing.assert_close(parts[0] + parts[1], whole(x), atol=1e-6, rtol=1e-5)
        finally:
            set_backend("auto")


def test_transformers_v5_stacked_experts_load_too(tmp_path):
    """A checkpoint of transformers v5's in-memory layout (`mlp.experts.gate_up_proj`
    [E, 2I, H], `mlp.experts.down_proj`; Mixtral's router under `mlp.gate`) serves alike."""
    from safetensors.torch import save_file

    model = build_hf_model(tmp_path / "hf", "mixtral", **TINY)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (stacked / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(stacked / "model.safetensors"))
    prompts = make_prompts(model.config.vocab_size, seed=4)[::4]
    seqs = engine(stacked, max_batched_tokens=32, max_running=8,
                  kv_cache_tokens=2048).generate(prompts, greedy(8))
    assert [s.output_ids for s in seqs] == hf_greedy(model, prompts, 8)


@pytest.mark.parametrize("name", ["qwen3_moe"])  # OLMoE's own part, its q/k norm: rms_norm
def test_triton_kernels_give_the_reference_tokens(name, tmp_path):
    """The GPU path (the fused MoE kernel and the others, Triton under its CPU interpreter)
    against the PyTorch references, an INT8 cache included."""
    arch, overrides = VARIANTS[name]
    build_hf_model(tmp_path, arch, initializer_range=0.1, num_hidden_layers=2, **overrides)
    prompts = [[5, 6, 7], list(range(3, 60)), [9]]
    outputs = {}
    try:
        for backend in ("reference", "triton"):
            eng = engine(tmp_path, max_batched_tokens=16, max_running=4, kv_cache_tokens=256,
                         kernels=backend, kv_cache_dtype="int8")
            assert (eng.runner.model.layers[0].moe.w13 is not None) == (backend == "triton")
            outputs[backend] = [s.output_ids for s in eng.generate(prompts, greedy(6))]
    finally:
        set_backend("auto")
    assert outputs["triton"] == outputs["reference"]


# --- GGUF -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "arch"), [("mixtral", "llama"), ("olmoe", "olmoe")])
def test_mixtral_and_olmoe_gguf_generate_what_transformers_does(tmp_path, name, arch):
    """llama.cpp stores Mixtral as `llama` (Q/K rows permuted) with expert stacks, OLMoE as
    `olmoe` (its whole-projection q/k norms as attn_q_norm / attn_k_norm)."""
    model = build_hf_model(tmp_path / "hf", name, **TINY)
    gguf = write_gguf(tmp_path / f"{name}.gguf", model, Q.F32, arch=arch)
    assert ModelConfig.from_path(gguf) == ModelConfig.from_path(tmp_path / "hf")
    prompts = make_prompts(model.config.vocab_size, seed=3)[::3]
    seqs = engine(gguf, max_batched_tokens=32, max_running=8, kv_cache_tokens=2048).generate(
        prompts, greedy(12))
    assert [s.output_ids for s in seqs] == hf_greedy(model, prompts, 12)


@pytest.fixture(scope="module")
def qwen3_moe_gguf(tmp_path_factory):
    """(HF dir, its F32 GGUF, its Q4_0 GGUF, HF model) of a Qwen3-MoE that llama.cpp can store:
    every layer sparse, the top-k renormalized (as Qwen3-30B-A3B)."""
    root = tmp_path_factory.mktemp("qwen3moe")
    model = build_hf_model(root / "hf", "qwen3_moe", **TINY, norm_topk_prob=True)
    files = [write_gguf(root / f"m-{q.name}.gguf", model, q, arch="qwen3moe")
             for q in (Q.F32, Q.Q4_0)]
    return root / "hf", *files, model


def test_qwen3_moe_gguf_generates_what_its_directory_does(qwen3_moe_gguf):
    hf_dir, f32, _, model = qwen3_moe_gguf
    assert ModelConfig.from_path(f32) == ModelConfig.from_path(hf_dir)
    prompts = make_prompts(model.config.vocab_size, seed=2)[::3]
    seqs = engine(f32, max_batched_tokens=32, max_running=8, kv_cache_tokens=2048).generate(
        prompts, greedy(12))
    assert [s.output_ids for s in seqs] == hf_greedy(model, prompts, 12)


def test_q4_expert_stacks_split_into_the_files_blocks(qwen3_moe_gguf):
    """With --quantization int4 a Q4_0 stack [E, rows, cols] becomes E Int4Weights holding
    exactly the values the float load dequantizes."""
    from pipellm.kernels.int4_weight import Int4Weight, dequantize_int4

    q4 = qwen3_moe_gguf[2]
    blocks = load_weights(q4, torch.float32, "cpu", keep_int4=True)
    floats = load_weights(q4, torch.float32, "cpu")
    assert blocks.keys() == floats.keys()
    for e in (0, 7):
        for part in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.1.mlp.experts.{e}.{part}.weight"
            assert isinstance(blocks[name], Int4Weight)
            torch.testing.assert_close(dequantize_int4(blocks[name]), floats[name], rtol=0,
                                       atol=0)


@pytest.mark.parametrize("method", list(TOLERANCE))
def test_each_quantization_method_scores_text_like_the_float_model(qwen3_moe_gguf, method):
    """The experts as the method's linear layers (CPU grouped path): perplexity against the
    float copy of the same Q4_0 file, as tests/test_quantization.py holds dense models."""
    q4 = qwen3_moe_gguf[2]
    ref = _perplexity(_engine(q4, quantization="none"))
    eng = _engine(q4, quantization=method)
    assert eng.runner.summary["quantization"] == method
    got = _perplexity(eng)
    assert abs(got / ref - 1) <= TOLERANCE[method], (got, ref)
    assert got != ref


def test_w8a8_smooths_the_dense_layers_and_quantizes_the_experts(reference):
    """SmoothQuant calibrates the attention (and Qwen3-MoE's dense layer 1); the experts take
    float rows (the router reads them) and quantize them per token."""
    path = reference[1]
    ref = _perplexity(_engine(path, quantization="none"))
    eng = _engine(path, quantization="w8a8")
    layers = eng.runner.model.layers
    assert type(layers[0].moe.experts[0][0]).__name__ == "W8A8Linear"
    assert (layers[1].moe is None) == (reference[0] == "qwen3_moe")
    got = _perplexity(eng)
    assert abs(got / ref - 1) <= TOLERANCE["w8a8"], (got, ref)


# --- refused configs --------------------------------------------------------------------------


def test_quantized_experts_are_refused_on_a_gpu(qwen3_moe_gguf):
    hf_dir, _, q4, _ = qwen3_moe_gguf
    gpu = torch.device("cuda", 0)
    with pytest.raises(ValueError, match="mixture-of-experts models on a GPU"):
        resolve("int4", str(hf_dir), gpu, torch.bfloat16)
    assert resolve("auto", str(q4), gpu, torch.bfloat16).name == "none"
    assert resolve("auto", str(q4), torch.device("cpu"), torch.float32).name == "int4"


@pytest.mark.parametrize(("arch", "changes", "needle"), [
    ("qwen3_moe", {"num_experts_per_tok": 9}, "'num_experts_per_tok' (9) exceeds"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "'moe_intermediate_size' is missing"),
    ("qwen3_moe", {"mlp_only_layers": [5]}, "'mlp_only_layers'"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "'decoder_sparse_step'"),
    ("mixtral", {"num_local_experts": None}, "'num_local_experts' is missing"),
    ("olmoe", {"clip_qkv": -1}, "'clip_qkv'"),
])
def test_unservable_moe_configs_name_the_field(tmp_path, arch, changes, needle):
    build_hf_model(tmp_path, arch, num_hidden_layers=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if arch == "qwen3_moe" and "num_experts_per_tok" in changes:
        cfg["num_experts"] = cfg.pop("num_local_experts")  # the real checkpoints' key
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(ModelLoadError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dir(tmp_path)


def test_qwen3_moe_window_only_with_use_sliding_window(tmp_path):
    build_hf_model(tmp_path, "qwen3_moe", num_hidden_layers=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for use, window in ((False, None), (True, 64)):
        (tmp_path / "config.json").write_text(json.dumps(
            {**cfg, "sliding_window": 64, "use_sliding_window": use}))
        mc = ModelConfig.from_dir(tmp_path)
        assert mc.sliding_window == window and mc.layer_window(1) == (window or 0)
