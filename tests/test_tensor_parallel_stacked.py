"""Transformers v5's expert stacks (`mlp.experts.gate_up_proj` [E, 2I, hidden],
`mlp.experts.down_proj` [E, hidden, I]) under tensor parallelism
(pipellm/services/compute/tp/shard.py): checkpoints written from the models' own state dicts
(`save_pretrained` writes per-expert names). A rank's parts read from safetensors are the per-expert
checkpoint's parts stacked, and the ranks' parts make the whole stacks again; two ranks over gloo
through `LLMEngine` against one rank, float32: greedy tokens identical, generated and prompt
logprobs within 1e-4 (FP8's split experts within its tolerance), every expert split or whole experts
a rank."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pipellm.services.compute.model.weights import load_weights
from pipellm.services.compute.tp.shard import Shard, ShardReader, shard_weights
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import SamplingParams
from tests.hf_models import build_hf_model
from tests.test_expert_parallel import EP, held_experts
from tests.test_tensor_parallel import (  # noqa: F401  (the fixtures)
    MODELS,
    PROMPTS,
    _keep_torch_threads,
    assert_same,
    generate,
    on_both,
)
from tests.test_tensor_parallel_quantized import QUANT_TOL

GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


@pytest.fixture(scope="module")
def stacked_dir(tmp_path_factory):
    """`stacked_dir(name)`: (the stacked checkpoint, the per-expert one) of MODELS[name],
    saved once per module."""
    made = {}

    def make(name: str):
        if name not in made:
            arch, kw = MODELS[name]
            root = tmp_path_factory.mktemp(name)
            model = build_hf_model(root / "hf", arch, **kw)
            (root / "stacked").mkdir()
            (root / "stacked" / "config.json").write_bytes((root / "hf/config.json").read_bytes())
            state = {n: t.contiguous() for n, t in model.state_dict().items()}
            assert GATE_UP in state and DOWN in state
            save_file(state, str(root / "stacked" / "model.safetensors"))
            made[name] = root / "stacked", root / "hf"
        return made[name]

    return make


def rank_parts(path, shard: Shard) -> dict[str, torch.Tensor]:
    """Rank `shard`'s weights as the TP loader makes them (ShardReader, then shard_weights);
    the same as those cut from the whole weights, the stacks read as their parts alone."""
    cfg = ModelConfig.from_path(path)
    read = ShardReader(cfg, shard)
    part = load_weights(path, torch.float32, take=read.take)
    assert all(n in read.taken for n in (GATE_UP, DOWN) if n in part)
    mine = shard_weights(cfg, part, shard, frozenset(read.taken))
    cut = shard_weights(cfg, load_weights(path, torch.float32), shard)
    assert mine.keys() == cut.keys()
    assert all(torch.equal(t, cut[n]) for n, t in mine.items())
    return mine


@pytest.mark.parametrize("parallel", [{}, EP])
def test_a_stack_cut_by_two_ranks_concatenates_back(stacked_dir, parallel):
    """Split experts: each rank's gate_up stack [8, 2 * 32, 64] is, expert by expert, its part
    of the per-expert gate_proj then of up_proj, down [8, 64, 32] its part of down_proj; rank
    0's and rank 1's gate, up and down parts make the whole stacks. Whole experts: rank r holds
    stack[4r : 4r + 4]. Each read from safetensors as its part alone."""
    stacked, per_expert = stacked_dir("qwen3-moe")
    whole = load_weights(stacked, torch.float32)
    ranks = [Shard(r, 2, **{"expert_parallel": bool(parallel)}) for r in range(2)]
    parts = [rank_parts(stacked, s) for s in ranks]
    gate_up, down = ([p[n] for p in parts] for n in (GATE_UP, DOWN))
    if parallel:
        assert [t.shape[0] for t in gate_up + down] == [4] * 4
        assert torch.equal(torch.cat(gate_up), whole[GATE_UP])
        assert torch.equal(torch.cat(down), whole[DOWN])
        return
    assert gate_up[0].shape == (8, 64, 64) and down[0].shape == (8, 64, 32)
    halves = [t.chunk(2, dim=1) for t in gate_up]  # each rank's (gate part, up part)
    gates, ups = ([h[i] for h in halves] for i in (0, 1))
    assert torch.equal(torch.cat(gates + ups, dim=1), whole[GATE_UP])
    assert torch.equal(torch.cat(down, dim=2), whole[DOWN])
    for shard, mine in zip(ranks, parts, strict=True):
        theirs = rank_parts(per_expert, shard)
        for e in range(8):
            p = f"model.layers.0.mlp.experts.{e}."
            expert = torch.cat([theirs[f"{p}gate_proj.weight"], theirs[f"{p}up_proj.weight"]])
            assert torch.equal(mine[GATE_UP][e], expert)
            assert torch.equal(mine[DOWN][e], theirs[f"{p}down_proj.weight"])


@pytest.mark.parametrize(("name", "parallel", "settings"), [
    ("qwen3-moe", {}, {}), ("qwen3-moe", EP, {}), ("olmoe", {}, {}),
    ("qwen3-moe-dense-layer", {}, {"quantization": "fp8"})])
def test_two_ranks_of_stacked_experts_match_one(stacked_dir, name, parallel, settings):
    """Chunked prefill and decodes (PROMPTS, steps of 16), generated and prompt logprobs;
    OLMoE: q/k norms over every rank's heads; FP8: each split expert's down quantized with the
    whole rows' scales. Rank 0's sparse layers hold 8 experts split, or 0..3 whole."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=0)
    held = []

    def run(eng):
        held.append(held_experts(eng))
        return generate(eng, PROMPTS, params)

    one, two = on_both(stacked_dir(name)[0], run, parallel=parallel, **settings)
    assert_same(one, two, QUANT_TOL if settings else 1e-4)
    assert held == [{(None, 8)}, {(range(0, 4), 4) if parallel else (None, 8)}]
