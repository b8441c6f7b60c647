"""Speculative decoding with a draft model under tensor parallelism (`--speculative-config
'{"model": PATH}'` with `--tensor-parallel-size 2`): the draft model runs whole on rank 0 (its
own KV cache there, moved with the target's), its proposals reach the other ranks in the
broadcast batch's verify rows. Through `LLMEngine` against one rank, float32: greedy tokens
identical, logprobs within 1e-4, as many drafts proposed and accepted."""

from __future__ import annotations

import json

from pipellm.shared.sampling import SamplingParams
from tests.test_tensor_parallel import (  # noqa: F401  (the fixtures)
    PROMPTS,
    _keep_torch_threads,
    assert_same,
    generate,
    model_dir,
    on_both,
)


def test_a_draft_model_on_rank_0_drafts_as_one_rank(model_dir):  # noqa: F811
    """The target drafts 3 tokens a step for itself (whole, on rank 0): its drafts are
    accepted, so the verify rows' logits, which read the drafted tokens on every rank, decide
    the output."""
    path = model_dir("llama")
    spec = json.dumps({"model": str(path), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)

    def run(eng):
        out = generate(eng, PROMPTS, params)
        stats = eng.stats()
        return out, (stats.spec_draft_tokens, stats.spec_accepted_tokens)

    (one, drafted_one), (two, drafted_two) = on_both(path, run, speculative_config=spec)
    assert_same(one, two)
    assert drafted_two == drafted_one and drafted_two[1] > 0
