"""Expert parallelism (`--tensor-parallel-size 2 --enable-expert-parallel`,
pipellm/services/compute/tp/): rank r holds experts [4r, 4r + 4) of 8 whole and none of the others',
attention still split across the ranks. Through `LLMEngine` against one rank: greedy tokens
identical, generated and prompt logprobs within 1e-4 (float32), for Qwen3-MoE (a dense layer among
the sparse ones), Mixtral (an INT8 KV cache) and OLMoE (q/k norms over every rank's heads); a rank
reads only its experts from safetensors, and keeps only its experts of whole loaded weights (a
GGUF file's way: one of Q4 blocks runs too); what it refuses, each with one line, and what it
does not."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from gguf import GGMLQuantizationType

from pipellm.services import cli
from pipellm.services.compute.backend import resolve
from pipellm.services.compute.model.weights import load_weights
from pipellm.services.compute.tp.shard import Shard, ShardReader, shard_weights
from pipellm.shared.config import EngineConfig
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.gguf_files import write_gguf
from tests.hf_models import build_hf_model
from tests.test_tensor_parallel import (  # noqa: F401  (the fixtures)
    ENGINE,
    PROMPTS,
    _keep_torch_threads,
    assert_same,
    engine,
    generate,
    model_dir,
    on_both,
)

EP = {"enable_expert_parallel": True}


def held_experts(eng) -> set:
    """(the block of experts held, None: all; how many) of each sparse layer of `eng`'s rank."""
    moes = [getattr(layer.moe, "linear", layer.moe)  # a rank's: inside its all-reduce
            for layer in eng.runner.model.layers if layer.moe is not None]
    return {(moe.held, len(moe.experts)) for moe in moes}


@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "mixtral", "olmoe"])
def test_two_ranks_of_whole_experts_match_one(model_dir, name):  # noqa: F811
    """Chunked prefill, decodes merged with prefills, generated and prompt logprobs; rank 0's
    sparse layers hold experts 0..3 alone (one rank: all 8)."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=0)
    held = []

    def run(eng):
        held.append(held_experts(eng))
        return generate(eng, PROMPTS, params)

    one, two = on_both(model_dir(name), run, parallel=EP, **ENGINE.get(name, {}))
    assert_same(one, two)
    assert held == [{(None, 8)}, {(range(0, 4), 4)}]


def test_a_rank_reads_only_its_experts(model_dir):  # noqa: F811
    """From safetensors, rank 1 of 2 reads experts 4..7 whole and no tensor of 0..3, the
    router whole and q's rows split; dropping the other experts from whole weights (a GGUF
    file, read whole) leaves the same tensors."""
    path, shard = model_dir("mixtral"), Shard(1, 2, expert_parallel=True)
    cfg = ModelConfig.from_path(path)
    read = ShardReader(cfg, shard)
    part, whole = load_weights(path, torch.float32, take=read.take), \
        load_weights(path, torch.float32)
    experts = {n: int(m.group(1)) for n in whole if (m := re.search(r"experts\.(\d+)\.", n))}
    assert {experts[n] for n in part if n in experts} == {4, 5, 6, 7}
    assert all(torch.equal(part[n], whole[n]) for n, e in experts.items() if e >= 4)
    router, q = "model.layers.0.block_sparse_moe.gate.weight", \
        "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(part[router], whole[router])
    assert torch.equal(part[q], whole[q][whole[q].shape[0] // 2:])
    mine, sliced = shard_weights(cfg, part, shard, read.taken), shard_weights(cfg, whole, shard)
    assert mine.keys() == sliced.keys() == part.keys()
    assert all(torch.equal(t, sliced[n]) for n, t in mine.items())


def test_a_gguf_files_other_experts_are_dropped_after_loading(tmp_path):
    """Mixtral as llama.cpp stores it (`llama`, expert stacks) in Q4_1 blocks, kept as they are
    (--quantization auto): read whole, split into experts, each rank keeps its four."""
    model = build_hf_model(tmp_path / "hf", "mixtral")
    gguf = write_gguf(tmp_path / "q4.gguf", model, GGMLQuantizationType.Q4_1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    one, two = on_both(gguf, lambda e: generate(e, PROMPTS, params), parallel=EP,
                       quantization="auto")
    assert_same(one, two)


@pytest.mark.parametrize(("arch", "overrides"), [
    ("qwen3_moe", {"num_experts": 7}), ("mixtral", {"num_local_experts": 5})])
def test_experts_two_ranks_do_not_divide_are_refused(tmp_path, arch, overrides):
    """By the engine, and by `pipellm serve` before any service starts (backend.resolve)."""
    build_hf_model(tmp_path, arch, **overrides)
    n = next(iter(overrides.values()))
    message = f"--enable-expert-parallel with --tensor-parallel-size 2 does not divide the " \
              f"model's {n} experts"
    with pytest.raises(ValueError, match=message) as e:
        engine(tmp_path, 2, **EP)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=message):
        resolve(with_settings(EngineConfig(), model=str(tmp_path), tensor_parallel_size=2, **EP))


def test_the_flag_without_tensor_parallelism_is_refused(model_dir, capsys):  # noqa: F811
    """By the command line (the flag is vLLM's), with one line."""
    code = cli.main(["serve", str(model_dir("mixtral")), "--enable-expert-parallel"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 2 and errors == ["pipellm: error: --enable-expert-parallel needs "
                                    "--tensor-parallel-size over 1 (the ranks the experts are "
                                    "spread over)"]


def test_whole_experts_need_not_split_their_intermediate_size(tmp_path):
    """63 columns two ranks cannot split (refused without the flag: test_tensor_parallel.py)
    are each expert's whole on its rank."""
    build_hf_model(tmp_path, "qwen3_moe", moe_intermediate_size=63)
    config = with_settings(EngineConfig(), model=str(tmp_path), tensor_parallel_size=2, **EP)
    assert resolve(config).enable_expert_parallel


def test_a_dense_model_ignores_the_flag(model_dir, caplog):  # noqa: F811
    """As vLLM does: its layers split as without it (resolve passes), one line logged."""
    config = with_settings(EngineConfig(), model=str(model_dir("llama")), tensor_parallel_size=2,
                           **EP)
    with caplog.at_level(logging.INFO, logger="pipellm.services.compute.tp.group"):
        resolve(config)
    assert "LlamaForCausalLM has no experts, its layers are split as without it" in caplog.text
