"""Tensor parallelism (`--tensor-parallel-size 2`, pipellm/services/compute/tp/): two ranks over
gloo on the CPU, one thread each, through `LLMEngine`, against the same engine on one rank: greedy
tokens identical, generated and prompt logprobs within 1e-4 (float32), through chunked prefill,
prefix caching, KV moves and preemption, an INT8 KV cache; bfloat16 close; mixtures of experts
(every expert split; whole experts a rank: tests/test_expert_parallel.py), OLMoE's q/k norms over
every rank's heads; INT4 weights (INT8 activations: within 1e-3); a vocabulary two ranks do
not divide (the last shard padded); a GGUF file of Q4 blocks; a dead rank; and the shapes and
settings it refuses, each with one line. Served, and across machines:
tests/test_tensor_parallel_e2e.py."""

from __future__ import annotations

import os
import random

import pytest
import torch
from gguf import GGMLQuantizationType

from pipellm.services.compute.backend import build_engine, resolve
from pipellm.services.compute.model.weights import load_weights
from pipellm.services.compute.tp.shard import Shard, ShardReader, shard_weights
from pipellm.shared.config import EngineConfig
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.gguf_files import write_gguf
from tests.hf_models import build_hf_model

TOL = 1e-4
# the C++ INT4 GEMM quantizes its activations to INT8 (per row and block of 32): a last-bit
# difference of an all-reduce's float sum may move one value across a rounding step, a change
# of one INT8 step, not of 1e-7 (kernels="reference", float activations, stays within TOL)
W4A8_TOL = 1e-3
MODELS = {  # build_hf_model's arch and config overrides
    "llama": ("llama", {"vocab_size": 509}),  # 255 vocabulary rows a rank, the last padded
    # q/k norms, head_dim 32 != hidden / heads; tied embeddings (the head is the embedding's
    # shard) and q/k/v biases (split with their rows)
    "qwen3": ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
    "gemma3": ("gemma3", {"num_hidden_layers": 3}),  # sliding layers, sandwich norms, scaled
    "phi3": ("phi3", {}),  # fused q/k/v and gate/up: read whole, split, then sliced
    # mixtures of experts, 8 experts of 64 (32 a rank), top 2: every expert split
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-dense-layer": ("qwen3_moe", {"mlp_only_layers": [1]}),  # layer 1 a dense MLP
    "mixtral": ("mixtral", {}),
    # q/k RMSNorm over the whole projection (the sums of squares all-reduced), q/k/v clipped
    "olmoe": ("olmoe", {"clip_qkv": 2.0}),
}
ENGINE = {  # engine settings of a model's test_two_ranks_match_one, on both sides
    # each rank quantizes its own heads' K/V: the groups of 8 lie within a head
    "mixtral": {"kv_cache_dtype": "int8"},
    # INT4 weights quantized after the split: a rank's columns are whole groups of 32
    "qwen3-moe": {"quantization": "int4"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """`model_dir(name)`: the tiny random model MODELS[name], saved once per module."""
    made = {}

    def make(name: str):
        if name not in made:
            arch, kw = MODELS[name]
            made[name] = tmp_path_factory.mktemp(name)
            build_hf_model(made[name], arch, **kw)
        return made[name]

    return make


@pytest.fixture(autouse=True, scope="module")
def _keep_torch_threads():
    """The engines here set this process's torch threads to 1; the next module gets its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def engine(path, tp: int, **kw):
    """LLMEngine on `tp` ranks, float32 (its KV cache too), one thread a rank, steps of 16
    tokens (prompts over 16 are prefilled in chunks)."""
    base = dict(model=str(path), device="cpu", dtype="float32", threads=1, quantization="none",
                kv_cache_tokens=2048, kv_cache_dtype="float32", max_batched_tokens=16,
                max_running=8, tensor_parallel_size=tp)
    return build_engine(with_settings(EngineConfig(), **base | kw))


def generate(eng, prompts, params):
    """[(output ids, their logprobs, prompt logprobs)] of each prompt, run to completion."""
    return [(s.output_ids, s.logprobs, s.prompt_logprobs)
            for s in eng.generate(prompts, params)]


def on_both(path, run, parallel: dict | None = None, **kw):
    """`run(engine)` on one rank, then on two (closed after: its ranks stop); `parallel`: the
    two ranks' own settings."""
    one = run(engine(path, 1, **kw))
    eng = engine(path, 2, **kw | (parallel or {}))
    try:
        two = run(eng)
    finally:
        eng.runner.close()
    assert all(p.returncode == 0 for p in eng.runner.ranks.procs)  # stopped cleanly
    return one, two


def assert_same(one, two, tol: float = TOL):
    """Greedy tokens identical, every logprob within `tol`."""
    assert [ids for ids, _, _ in two] == [ids for ids, _, _ in one]
    for (_, lp1, pl1), (_, lp2, pl2) in zip(one, two, strict=True):
        pairs = zip(lp1 + pl1, lp2 + pl2, strict=True)
        assert max((abs(a - b) for a, b in pairs), default=0) < tol


PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for i in range(5 + 11 * j)] for j in range(4)]  # 5..38


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_match_one(model_dir, name):
    """Chunked prefill (prompts up to 38 tokens, steps of 16), decodes merged with prefills,
    generated and prompt logprobs (both through the gathered LM head); ENGINE's settings."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=0)
    settings = ENGINE.get(name, {})
    one, two = on_both(model_dir(name), lambda e: generate(e, PROMPTS, params), **settings)
    assert_same(one, two, W4A8_TOL if settings.get("quantization") == "int4" else TOL)
    assert all(len(pl) == len(p) - 1 for (_, _, pl), p in zip(two, PROMPTS, strict=True))


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_a_rank_reads_only_its_part_of_each_split_tensor(model_dir, name):
    """ShardReader's parts, read from safetensors, are the whole tensors' parts: rank 1 of 2
    holds the second half of q's rows and of o's columns, and vocabulary rows 255..508 and
    one zero row; Phi-3's fused projections are read whole and sliced after their split."""
    path, shard = model_dir(name), Shard(1, 2)
    cfg = ModelConfig.from_path(path)
    read = ShardReader(cfg, shard)
    part, whole = load_weights(path, torch.float32, take=read.take), \
        load_weights(path, torch.float32)
    mine = shard_weights(cfg, part, shard, frozenset(read.taken))
    assert mine.keys() == whole.keys()
    assert all(torch.equal(t, shard_weights(cfg, whole, shard)[n]) for n, t in mine.items())
    q, o = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qo")
    assert torch.equal(mine[q], whole[q][whole[q].shape[0] // 2:])
    assert torch.equal(mine[o], whole[o][:, whole[o].shape[1] // 2:])
    assert (q in read.taken) == (name == "llama")  # Phi-3's q is a part of qkv_proj
    if name == "llama":
        embed = mine["model.embed_tokens.weight"]
        assert embed.shape[0] == 255 and not embed[-1].any()
        assert torch.equal(embed[:-1], whole["model.embed_tokens.weight"][255:])


def test_bfloat16_runs_close_to_one_rank(model_dir):
    """bf16 weights and all-reduces: each rank's partial sums are rounded to bf16 before they
    are added, so logprobs move by bf16's rounding (not 1e-4); greedy tokens still agree on
    this model."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
    one, two = on_both(model_dir("llama"), lambda e: generate(e, PROMPTS, params),
                       dtype="bfloat16", kv_cache_dtype="auto")
    assert [ids for ids, _, _ in two] == [ids for ids, _, _ in one]
    diffs = [abs(a - b) for (_, x, _), (_, y, _) in zip(one, two, strict=True)
             for a, b in zip(x, y, strict=True)]
    assert 0 < max(diffs) < 0.05  # bf16 rounding, not the float32 path


def test_a_gguf_file_is_sliced_after_loading(tmp_path):
    """A GGUF file of Q4_1 blocks (kept as they are: --quantization auto) is read whole, then
    each rank keeps its blocks: rows, or whole groups of columns."""
    model = build_hf_model(tmp_path / "hf", "llama")
    gguf = write_gguf(tmp_path / "q4.gguf", model, GGMLQuantizationType.Q4_1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    one, two = on_both(gguf, lambda e: generate(e, PROMPTS, params), quantization="auto")
    assert_same(one, two)


def test_int4_groups_a_rank_would_cut_are_refused(tmp_path):
    build_hf_model(tmp_path, "llama", intermediate_size=96)  # 48 columns of down a rank
    with pytest.raises(ValueError, match="48 columns of the model's intermediate size are not "
                       "whole groups of 32"):
        engine(tmp_path, 2, quantization="int4")


SYSTEM = [1] + [(13 * j) % 400 + 5 for j in range(40)]  # a shared system prompt


def conversations(eng, rounds: int = 3, chats: int = 5):
    """`chats` multi-turn conversations behind SYSTEM, side by side; their outputs, and the
    engine's stats at the end."""
    rng = random.Random(0)
    prompts = [SYSTEM + [rng.randrange(3, 500) for _ in range(rng.randint(2, 12))]
               for _ in range(chats)]
    out = []
    for r in range(rounds):
        params = [SamplingParams(max_tokens=6 + (r + c) % 5, temperature=0, ignore_eos=True,
                                 logprobs=True) for c in range(chats)]
        seqs = eng.generate(prompts, params)
        out += [(s.output_ids, s.logprobs, []) for s in seqs]
        prompts = [p + s.output_ids + [rng.randrange(3, 500) for _ in range(3)]
                   for p, s in zip(prompts, seqs, strict=True)]
    return out, eng.stats()


def test_prefix_caching_moves_and_preemption_match_one_rank(model_dir):
    """A tight cache: hits copy cached K/V (moves every rank applies to its own heads),
    segments move and requests are preempted, as rank 0's allocator decides; under the overlap
    schedule, so that a step's input ids sampled by the step before are resolved on rank 0."""
    (one, _), (two, stats) = on_both(
        model_dir("llama"), conversations, enable_prefix_caching=True, kv_cache_tokens=300,
        default_predicted_len=2, kv_min_grow=2, overlap_schedule="on")
    assert_same(one, two)
    assert stats.prefix_hits > 0 and stats.moves > 0 and stats.preemptions > 0


@pytest.mark.parametrize(("overrides", "size", "message"), [
    ({"num_key_value_heads": 1}, 2, "does not divide the model's 1 KV heads"),
    ({}, 3, "does not divide the model's 4 attention heads"),
    ({"intermediate_size": 129}, 2, "does not divide the model's 129 intermediate size"),
])
def test_shapes_it_does_not_divide_are_refused(tmp_path, overrides, size, message):
    """By the engine, and by `pipellm serve` before any service starts (backend.resolve)."""
    build_hf_model(tmp_path, "llama", **({"num_attention_heads": 4} | overrides))
    with pytest.raises(ValueError, match=message) as e:
        engine(tmp_path, size)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=message):
        resolve(with_settings(EngineConfig(), model=str(tmp_path), tensor_parallel_size=size))


@pytest.mark.parametrize(("setting", "message"), [
    ({"device": "cuda"}, "does not go with --device cuda"),
    ({"tensor_parallel_size": 0}, "must be at least 1"),
    ({"nnodes": 3}, "--nnodes 3 must divide --tensor-parallel-size 2"),
    ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "--node-rank be below it"),
    ({"nnodes": 2}, "--nnodes over 1 needs --master-port"),
])
def test_settings_it_cannot_run_are_refused(setting, message):
    with pytest.raises(ValueError, match=message) as e:
        with_settings(EngineConfig(), **{"tensor_parallel_size": 2} | setting)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("arch", "overrides", "message"), [
    ("qwen3_moe", {"moe_intermediate_size": 63}, "63 experts' intermediate size"),
    ("mixtral", {"intermediate_size": 65}, "65 experts' intermediate size"),
])
def test_experts_it_cannot_split_are_refused(tmp_path, arch, overrides, message):
    build_hf_model(tmp_path, arch, **overrides)
    with pytest.raises(ValueError, match=message):
        engine(tmp_path, 2)


def test_a_dead_rank_fails_the_next_step_at_once(model_dir):
    """gloo sees the closed connection: the step raises, it does not hang; close still ends
    the group (a later engine may start one)."""
    eng = engine(model_dir("llama"), 2)
    rank1 = eng.runner.ranks.procs[0]
    rank1.kill()
    rank1.wait()
    try:
        with pytest.raises(RuntimeError, match="Connection (closed|reset) by peer"):
            eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    finally:
        eng.runner.close()
    assert not torch.distributed.is_initialized()



def test_each_rank_of_each_data_parallel_compute_gets_its_share_of_cores(monkeypatch):
    """--data-parallel-size 4 x --tensor-parallel-size 2 on 16 cores: 2 threads a rank."""
    from pipellm.services.supervisor import compute_env

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    env = compute_env(EngineConfig(model="unused", tensor_parallel_size=2), 4, 2)
    assert env["PIPELLM_THREADS"] == "2"
