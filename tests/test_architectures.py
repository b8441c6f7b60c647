"""Qwen3, Phi-3, Gemma 3 and Gemma 2 against transformers on tiny random models (3 layers, 4
heads over 2 KV heads, float32): greedy tokens through the engine (chunked prefill, mixed
batches, preemption, prefix caching, an INT8 KV cache), logprobs, the same models as GGUF
files, Phi-3's LongRoPE in the regimes where pipellm's rule and transformers' agree
(pipellm/services/compute/model/rope.py), and the configs we refuse.

Variants: qwen3 (q/k RMSNorm before RoPE, head_dim 32 != hidden / heads), phi3 (fused qkv and
gate_up, a window of 24 on every layer), phi3-partial (partial_rotary_factor 0.5, as
Phi-4-mini's 0.75), gemma3 (sandwich norms, (1 + w) RMSNorm, scaled embeddings, GELU-tanh, q/k
norms, sliding and full layers with their own RoPE bases), gemma2 (soft-capped attention
scores and logits).
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys

import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.shared.config import EngineConfig
from pipellm.shared.gguf.names import NOT_WEIGHTS, hf_name
from pipellm.shared.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.gguf_files import GEMMA, Q, dequantized, write_gguf
from tests.hf_models import build_hf_model
from tests.test_engine_vs_hf import MAX_NEW, engine_greedy, hf_greedy, make_prompts
from tests.test_logprobs import hf_logprobs

TINY = dict(initializer_range=0.1, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, with_tokenizer=True)  # the demo tokenizer: GGUF needs one
VARIANTS = {  # name: (ARCHES key, config overrides)
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {"sliding_window": 24}),  # Phi-3-mini's is 2047: on every layer
    "phi3-partial": ("phi3", {"partial_rotary_factor": 0.5}),
    "gemma3": ("gemma3", {}),
    "gemma2": ("gemma2", {}),
}
GGUF_TYPES = {"qwen3": [Q.F32, Q.F16, Q.Q8_0], "phi3": [Q.F32, Q.F16], "phi3-partial": [Q.F32],
              "gemma3": [Q.F32, Q.Q8_0], "gemma2": [Q.F32]}


def engine(model, **settings):
    """The engine as transformers runs the model: float32, and a float32 KV cache unless
    `settings` names another (auto would keep it in fp16 on the CPU kernels)."""
    settings = {"kv_cache_dtype": "float32", **settings}
    return build_engine(with_settings(EngineConfig(), model=str(model), device="cpu",
                                      dtype="float32", **settings))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def build_reference(name: str, variants: dict, tmp_path_factory):
    """(name, model dir, HF model, prompts, HF's greedy continuations) of variants[name]: what
    the engine tests here take (tests/test_moe.py builds its own variants with it)."""
    arch, overrides = variants[name]
    path = tmp_path_factory.mktemp(name) / "hf"
    model = build_hf_model(path, arch, **TINY, **overrides)
    prompts = make_prompts(model.config.vocab_size)
    return name, path, model, prompts, hf_greedy(model, prompts, MAX_NEW)


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
    return build_reference(request.param, VARIANTS, tmp_path_factory)


def test_config_reads_the_architecture(reference):
    name, path, model, _, _ = reference
    cfg = ModelConfig.from_path(path)
    assert cfg.architecture == type(model).__name__ and not cfg.attention_bias
    assert cfg.qk_norm == (name in ("qwen3", "gemma3"))
    assert cfg.head_dim == (32 if name in ("qwen3", "gemma3", "gemma2") else 16)
    assert cfg.sandwich_norms == name.startswith("gemma")
    windows = {"phi3": [24] * 3, "gemma3": [16, 0, 16], "gemma2": [16, 0, 16]}
    assert [cfg.layer_window(i) for i in range(3)] == windows.get(name, [0, 0, 0])
    assert cfg.rotary_dim == (8 if name == "phi3-partial" else cfg.head_dim)


def test_chunked_prefill_and_mixed_batches_match_hf(reference):
    """16 prompts of 1-300 tokens arriving staggered, 48 tokens a step: prefills are chunked and
    share steps with other requests' decodes; with the overlap schedule (step N+1 launched
    before step N's tokens are committed)."""
    _, path, _, prompts, expected = reference
    got, eng = engine_greedy(path, prompts, max_batched_tokens=48, max_running=16,
                             kv_cache_tokens=8192, overlap_schedule="on")
    assert got == expected
    assert eng.stats().reserved == 0


def test_preemption_matches_hf(reference):
    _, path, _, prompts, expected = reference
    got, eng = engine_greedy(path, prompts, max_batched_tokens=48, max_running=16,
                             kv_cache_tokens=360, default_predicted_len=2, kv_min_grow=4)
    assert eng.stats().preemptions > 0
    assert got == expected


def check_prefix_caching(reference, shared_len: int, suffixes: tuple[int, ...], new: int,
                         max_batched_tokens: int) -> None:
    """Prompts sharing a `shared_len`-token prefix, the first run alone (it caches the prefix):
    every greedy continuation equals HF's, and the cache was hit."""
    _, path, model, _, _ = reference
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(shared_len)]
    prompts = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in suffixes]
    expected = hf_greedy(model, prompts, new)
    eng = engine(path, max_batched_tokens=max_batched_tokens, max_running=8,
                 kv_cache_tokens=2048, enable_prefix_caching=True)
    first = eng.generate(prompts[:1], greedy(new))  # caches the shared prefix
    rest = eng.generate(prompts[1:], greedy(new))
    assert [s.output_ids for s in first + rest] == expected
    assert eng.stats().prefix_hits > 0


def test_prefix_caching_matches_hf(reference):
    check_prefix_caching(reference, 40, (3, 9, 1, 17, 6), 10, max_batched_tokens=32)


def check_int8_kv_per_step(reference, prompts, new: int, max_batched_tokens: int,
                           max_running: int) -> None:
    """tests/test_kv_int8.py's tolerance of 0.05 in logprob at every step: on a random model
    the greedy paths of the INT8 and float caches part at near-ties (where is a matter of
    luck), so each INT8 token is held to transformers on the INT8 engine's own sequence: its
    logprob within 0.05 of transformers', and within 0.05 of transformers' best (it is the
    argmax or a near-tie)."""
    _, path, model, _, _ = reference
    seqs = engine(path, kv_cache_dtype="int8", max_batched_tokens=max_batched_tokens,
                  max_running=max_running, kv_cache_tokens=4096).generate(
        prompts, greedy(new, logprobs=True))
    for seq, prompt in zip(seqs, prompts, strict=True):
        rows = hf_logprobs(model, seq.token_ids)[len(prompt) - 1:-1]  # [new, vocab]
        chosen = rows[torch.arange(new), torch.tensor(seq.output_ids)]  # [new]
        assert (torch.tensor(seq.logprobs) - chosen).abs().max() < 0.05
        assert (rows.max(-1).values - chosen).max() < 0.05


def test_int8_kv_cache_stays_close_to_hf(reference):
    check_int8_kv_per_step(reference, reference[3][::2], MAX_NEW, max_batched_tokens=48,
                           max_running=16)


def test_logprobs_match_hf_log_softmax(reference):
    _, path, model, prompts, _ = reference
    prompts = prompts[::3]
    seqs = engine(path, max_batched_tokens=48, max_running=16, kv_cache_tokens=4096).generate(
        prompts, greedy(8, logprobs=True, prompt_logprobs=0))
    for seq, prompt in zip(seqs, prompts, strict=True):
        ref = hf_logprobs(model, seq.token_ids)  # [prompt + output, vocab]
        P = len(prompt)
        want = ref[torch.arange(P - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(torch.tensor(seq.prompt_logprobs), want, atol=1e-3,
                                   rtol=0)
        rows = ref[P - 1:P - 1 + len(seq.output_ids)]
        assert seq.output_ids == rows.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(seq.logprobs), rows.max(-1).values,
                                   atol=1e-3, rtol=0)


def test_gguf_files_generate_what_transformers_does(reference, tmp_path):
    """F32: the GGUF file's config and tokens equal the HF directory's. F16/Q8_0 round the
    weights, which may move a near-tie: their tokens are transformers' on the same rounded
    weights (the file's values, loaded into the HF model)."""
    name, path, model, prompts, expected = reference
    arch = VARIANTS[name][0]
    prompts, expected = prompts[::3], [e[:12] for e in expected[::3]]
    settings = dict(max_batched_tokens=32, max_running=8, kv_cache_tokens=2048)
    for qtype in GGUF_TYPES[name]:
        gguf = write_gguf(tmp_path / f"{name}-{qtype.name}.gguf", model, qtype, arch=arch)
        got = [s.output_ids for s in engine(gguf, **settings).generate(prompts, greedy(12))]
        if qtype == Q.F32:
            assert ModelConfig.from_path(gguf) == ModelConfig.from_path(path)
            want = expected
        else:
            want = hf_greedy(_with_gguf_weights(model, qtype, arch), prompts, 12)
        assert got == want, qtype.name


def test_hidden_state_length_head_reads_every_architecture(reference):
    """--hidden-length probes the final-normed hidden state [hidden] of every architecture
    (Gemma's sandwich norms included) at each request's checkpoints, changing no token."""
    from pipellm.services.compute.length.refiner import RefinerConfig

    _, path, _, prompts, expected = reference
    eng = engine(path, max_batched_tokens=48, max_running=16, kv_cache_tokens=8192,
                 hidden_length=True, length_refine_every=8)
    eng.lengths.config = RefinerConfig(min_requests=4, push_s=0, refresh_s=0, background=False)
    seen, observe = [], eng.lengths.observe

    def recording(checkpoints):  # (sequence, generated, probe [hidden]) per checkpoint
        seen.extend(probe.shape for *_, probe in checkpoints)
        return observe(checkpoints)

    eng.lengths.observe = recording
    assert [s.output_ids for s in eng.generate(prompts, greedy(MAX_NEW))] == expected
    assert eng.runner.probe_dim == eng.model_config.hidden_size
    assert seen and set(seen) == {(eng.model_config.hidden_size,)}


def test_phi3_fused_q4_blocks_split_exactly(tmp_path):
    """A Phi-3 GGUF's fused attn_qkv / ffn_up kept as Q4 blocks (--quantization int4) split into
    q/k/v and gate/up blocks holding exactly the values the float load dequantizes."""
    from pipellm.kernels.int4_weight import Int4Weight, dequantize_int4
    from pipellm.services.compute.model.weights import load_weights

    model = build_hf_model(tmp_path / "hf", "phi3", **TINY)
    gguf = write_gguf(tmp_path / "q4.gguf", model, Q.Q4_0, arch="phi3")
    blocks = load_weights(gguf, torch.float32, "cpu", keep_int4=True)
    floats = load_weights(gguf, torch.float32, "cpu")
    assert blocks.keys() == floats.keys() and not any("qkv" in n or "gate_up" in n
                                                      for n in blocks)
    for n in ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        w = blocks[f"model.layers.2.{n}.weight"]
        assert isinstance(w, Int4Weight)
        torch.testing.assert_close(dequantize_int4(w), floats[f"model.layers.2.{n}.weight"])


def _with_gguf_weights(model, qtype, arch: str):
    """A copy of the HF model holding the weights `write_gguf(..., qtype)` stores."""
    state = {hf_name(n, arch): torch.from_numpy(t) for n, t in
             dequantized(model, qtype, arch).items() if n not in NOT_WEIGHTS.get(arch, ())}
    if arch in GEMMA:  # the file's norms are 1 + w
        state = {n: t - 1 if n.endswith("norm.weight") else t for n, t in state.items()}
    rounded = copy.deepcopy(model)
    missing, unexpected = rounded.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return rounded


# --- Phi-3 LongRoPE ---------------------------------------------------------------------------

ORIGINAL = 64  # original_max_position_embeddings; max_position_embeddings 256


@pytest.fixture(scope="module", params=[1.0, 0.5], ids=["full", "partial"])
def longrope(request, tmp_path_factory):
    """A Phi-3 with LongRoPE factors of rotary_dim / 2 (factor 4, attention factor 1.155)."""
    half = int(16 * request.param) // 2
    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + 1.5 * i for i in range(half)]}
    path = tmp_path_factory.mktemp("longrope") / "hf"
    model = build_hf_model(path, "phi3", **TINY, max_position_embeddings=256,
                           original_max_position_embeddings=ORIGINAL, rope_scaling=rope,
                           partial_rotary_factor=request.param)
    return path, model


def random_prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lens]


def test_longrope_short_factors_within_the_original_length(longrope):
    """Served with --max-model-len 64 (= original): the short factors, as transformers uses
    them for every sequence that ends within the original length."""
    path, model = longrope
    prompts = random_prompts([1, 20, 40, 52])
    seqs = engine(path, max_model_len=ORIGINAL, max_batched_tokens=16, max_running=8,
                  kv_cache_tokens=1024).generate(prompts, greedy(12))
    assert [s.output_ids for s in seqs] == hf_greedy(model, prompts, 12)


def test_longrope_long_factors_beyond_the_original_length(longrope, tmp_path):
    """Served with the model's 256 positions: the long factors, as transformers uses them for
    prompts already longer than the original length (HF directory and GGUF file)."""
    path, model = longrope
    prompts = random_prompts([65, 100, 150, 200])
    expected = hf_greedy(model, prompts, 24)
    gguf = write_gguf(tmp_path / "longrope.gguf", model, Q.F32, arch="phi3")
    assert ModelConfig.from_path(gguf) == ModelConfig.from_path(path)
    for source in (path, gguf):
        seqs = engine(source, max_batched_tokens=48, max_running=8,
                      kv_cache_tokens=2048).generate(prompts, greedy(24))
        assert [s.output_ids for s in seqs] == expected, source


def test_longrope_long_server_runs_long_factors_at_every_length(longrope):
    """Where the rules differ (a sequence that starts within the original length on a server
    of more positions), pipellm runs the long factors throughout, as vLLM does: transformers
    with its short factors replaced by the long ones gives the same tokens."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path, model = longrope
    prompts = random_prompts([10, 40, 60], seed=1)  # 60 + 30 crosses 64 while decoding
    long_only = copy.deepcopy(model)
    rotary = long_only.model.rotary_emb
    long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](long_only.config, None, seq_len=ORIGINAL + 1)
    rotary.original_inv_freq.copy_(long_inv)
    rotary.inv_freq.copy_(long_inv)
    seqs = engine(path, max_batched_tokens=16, max_running=8,
                  kv_cache_tokens=1024).generate(prompts, greedy(30))
    assert [s.output_ids for s in seqs] == hf_greedy(long_only, prompts, 30)


@pytest.mark.parametrize("name", ["gemma3", "phi3-partial-longrope"])
def test_triton_kernels_give_the_reference_tokens(name, tmp_path):
    """The GPU path (Triton, here under its CPU interpreter) against the reference kernels:
    Gemma 3 (q/k RMSNorm on [T, H, D] heads, GELU-tanh, windows, and here a soft-cap on the
    scores) and Phi-3 (RoPE tables padded for partial rotary), with an INT8 cache."""
    from pipellm.kernels.dispatch import set_backend

    half = {"short_factor": [1.0, 1.5, 2.0, 2.5], "long_factor": [2.0, 3.0, 4.0, 5.0]}
    gemma = dict(attn_logit_softcapping=1.0, layer_types=["sliding_attention", "full_attention"])
    overrides = gemma if name == "gemma3" else dict(
        partial_rotary_factor=0.5, max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL, rope_scaling={"rope_type": "longrope", **half})
    build_hf_model(tmp_path, name.split("-")[0], initializer_range=0.1, num_hidden_layers=2,
                   **overrides)
    prompts = [[5, 6, 7], list(range(3, 80)), [9]]
    outputs = {}
    try:
        for backend in ("reference", "triton"):
            eng = engine(tmp_path, max_batched_tokens=16, max_running=4, kv_cache_tokens=256,
                         kernels=backend, kv_cache_dtype="int8")
            outputs[backend] = [s.output_ids for s in eng.generate(prompts, greedy(6))]
    finally:
        set_backend("auto")
    assert outputs["triton"] == outputs["reference"]


# --- refused configs ----------------------------------------------------------------------------


def test_an_unsupported_architecture_fails_at_start_up_in_one_line(tmp_path):
    build_hf_model(tmp_path, "qwen3", num_hidden_layers=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    out = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "up",
                          "--model", str(tmp_path), "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "'GPT2LMHeadModel' is not supported" in lines[0], out.stderr
    assert all(arch in lines[0] for arch in SUPPORTED_ARCHITECTURES)


ROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize(("arch", "changes", "needle"), [
    ("llama", {"rope_scaling": ROPE}, "'longrope' is not supported for LlamaForCausalLM"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor != 1 is not supported"),
    ("phi3", {"rope_scaling": {**ROPE, "short_factor": [1.0] * 7}}, "'short_factor'"),
    ("phi3", {"rope_scaling": {**ROPE, "long_factor": None}}, "'long_factor'"),
    ("phi3", {"partial_rotary_factor": 0.1875}, "partial_rotary_factor"),  # 3 dims: odd
    ("phi3", {"original_max_position_embeddings": 0, "rope_scaling": ROPE},
     "'original_max_position_embeddings'"),
    ("phi3", {"rope_scaling": {**ROPE, "rope_type": "yarn"}}, "rope type 'yarn'"),
])
def test_unservable_rope_configs_name_the_field(tmp_path, arch, changes, needle):
    build_hf_model(tmp_path, arch, num_hidden_layers=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **changes}))
    with pytest.raises(ModelLoadError, match=needle.replace("(", r"\(")):
        ModelConfig.from_dir(tmp_path)


def test_su_is_longrope(tmp_path):
    """Early Phi-3 configs name LongRoPE "su"; the v4 layout (rope_scaling, top-level
    original_max_position_embeddings) reads as transformers reads it."""
    build_hf_model(tmp_path, "phi3", num_hidden_layers=1, max_position_embeddings=256)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg |= {"rope_scaling": {**ROPE, "type": "su", "rope_type": None},
            "original_max_position_embeddings": 64, "rope_theta": 500.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_dir(tmp_path)
    assert mc.rope_theta == 500.0 and mc.rope_scaling["rope_type"] == "longrope"
    assert mc.rope_scaling["original_max_position_embeddings"] == 64
    assert mc.rope_scaling["attention_factor"] == pytest.approx(1.1547005, abs=1e-7)
