"""The pooling runner under tensor parallelism (`--runner pooling --tensor-parallel-size 2`):
rank 0 broadcasts each pooling forward (tp/step.StepInputs, `pooled`), every rank runs the
layers without the LM head, rank 0 pools. Through `LLMEngine.embed` against one rank, float32:
every embedding within 1e-5, mean pooling (every row) and last-token pooling (the last MLP on
the pooled rows alone), truncated to a Matryoshka width too; a sequence classifier's and a
yes/no reranker's scores."""

from __future__ import annotations

import pytest
import torch

from tests.scoring_models import YES_NO_OVERRIDES, build_classifier, build_yes_no
from tests.test_tensor_parallel import (  # noqa: F401  (the fixtures)
    _keep_torch_threads,
    model_dir,
    on_both,
)

POOL_TOL = 1e-5  # float32 sums of the all-reduces: last bits of a unit vector's entries
# prompts of 1..60 tokens, more than one pooling forward's budget (2048 tokens) together
PROMPTS = [[(13 * i + 5 * j) % 500 + 3 for i in range(1 + (17 * j) % 60)] for j in range(80)]


@pytest.mark.parametrize(("name", "pooling"), [("llama", "MEAN"), ("qwen3", "LAST")])
def test_two_ranks_embed_as_one(model_dir, name, pooling):  # noqa: F811
    config = f'{{"pooling_type": "{pooling}"}}'
    one, two = on_both(model_dir(name), lambda e: (e.embed(PROMPTS), e.embed(PROMPTS[:5], 16)),
                       runner="pooling", pooler_config=config)
    for a, b in zip(one, two, strict=True):
        assert a.shape == b.shape and a.shape[0] in (len(PROMPTS), 5)
        assert torch.isfinite(b).all() and b.abs().max() > 0
        assert (a - b).abs().max().item() < POOL_TOL


def test_a_shared_prefix_as_one_rank(model_dir):  # noqa: F811
    """Prompts behind one instruction, pooled by the last token: rank 0 runs the instruction
    once and broadcasts the moves that copy its K/V with the next forward; every rank moves."""
    prompts = [PROMPTS[40] + p for p in PROMPTS[:12]]  # the same 21 tokens before each
    one, two = on_both(model_dir("qwen3"), lambda e: e.embed(prompts), runner="pooling",
                       pooler_config='{"pooling_type": "LAST"}')
    assert one.shape == two.shape and one.shape[0] == 12 and one.abs().max() > 0
    assert (one - two).abs().max().item() < POOL_TOL


def test_a_classifier_scores_as_one_rank(tmp_path):
    """A sequence classifier's `score` head, whole on every rank, over rank 0's pooled rows."""
    build_classifier(tmp_path, 3)
    one, two = on_both(tmp_path, lambda e: e.classify(PROMPTS[:20]), runner="pooling")
    assert one.shape == two.shape == (20, 3)
    assert (one - two).abs().max().item() < POOL_TOL


def test_a_yes_no_reranker_scores_as_one_rank(tmp_path):
    """Its score rows, the LM head's rows of the (no, yes) tokens, gathered from the ranks'
    vocabulary parts at load."""
    build_yes_no(tmp_path)
    one, two = on_both(tmp_path, lambda e: e.classify(PROMPTS[:20]), runner="pooling",
                       hf_overrides=YES_NO_OVERRIDES)
    assert one.shape == two.shape == (20, 1) and one.abs().max() > 0
    assert (one - two).abs().max().item() < POOL_TOL
