"""Prompt logprobs and top-k logprobs in the engine, against HF transformers on tiny random models.

Requests arrive staggered, prefills are chunked, and in one variant the KV pool is so small that
requests are preempted and recomputed: every prompt position is still scored exactly once.
"""

from __future__ import annotations

import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.engine import LLMEngine
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.test_engine_vs_hf import make_prompts, run_staggered

K = 5
MAX_NEW = 12


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from tests.hf_models import build_hf_model

    path = tmp_path_factory.mktemp("llama")
    model = build_hf_model(path, "llama", initializer_range=0.1, num_key_value_heads=2)
    return path, model


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log p(. | ids[:i + 1])."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_top(records, ref: torch.Tensor) -> None:
    """records: Tokens with K alternatives per row; ref [rows, vocab]: HF's logprobs. The
    values are HF's K best, and each id has the value given (near-ties in either order)."""
    ids = torch.tensor([i for r in records for i in r.top_ids]).view(-1, K)
    values = torch.tensor([v for r in records for v in r.top_logprobs]).view(-1, K)
    assert torch.allclose(values, ref.topk(K).values, atol=1e-4)
    assert torch.allclose(ref.gather(1, ids), values, atol=1e-4)


def record_steps(engine: LLMEngine) -> tuple[dict, dict]:
    """From now on, each request's output records and prompt-logprob pieces, by request id."""
    outputs, pieces, step = {}, {}, engine.step

    def recorded():
        result = step()
        for record in result.outputs:
            outputs.setdefault(record.request_id, []).append(record)
        for piece in result.prompt:
            pieces.setdefault(piece.request_id, []).append(piece)
        return result

    engine.step = recorded
    return outputs, pieces


def run(engine: LLMEngine, prompts, params):
    """run_staggered, keeping each request's Sequence, its prompt-logprob pieces and its
    output records."""
    seqs, add = {}, engine.add_request
    outputs, pieces = record_steps(engine)

    def keep(prompt, p):
        rid = add(prompt, p)
        seqs[rid] = engine.requests[rid]  # the engine forgets it once finished
        return rid

    engine.add_request = keep
    rids = run_staggered(engine, prompts, params)
    return ([seqs[r] for r in rids], [pieces.get(r, []) for r in rids],
            [outputs.get(r, []) for r in rids])


@pytest.mark.parametrize("cfg", [
    dict(kv_cache_tokens=8192),
    dict(kv_cache_tokens=360, default_predicted_len=2, kv_min_grow=4),  # moves, preemption
], ids=["roomy", "preempting"])
def test_prompt_and_top_logprobs_match_hf(hf, cfg):
    path, model = hf
    prompts = make_prompts(model.config.vocab_size)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=True,
                            top_logprobs=K, prompt_logprobs=K)
    engine = build_engine(with_settings(EngineConfig(), model=str(path), device="cpu",
                                        dtype="float32", kv_cache_dtype="float32",
                                        max_batched_tokens=48, max_running=16, **cfg))
    seqs, pieces, outputs = run(engine, prompts, params)
    if "default_predicted_len" in cfg:
        assert engine.stats().preemptions > 0
    for seq, got_pieces, records, prompt in zip(seqs, pieces, outputs, prompts, strict=True):
        ref = hf_logprobs(model, seq.token_ids)  # prompt + generated
        P = len(prompt)
        # each prompt position 1..P-1 scored once, in order, across chunk-sized pieces
        got = [(p.start, len(p.token_ids)) for p in got_pieces]
        assert sum(n for _, n in got) == P - 1 == len(seq.prompt_logprobs)
        assert [s for s, _ in got] == [1 + sum(n for _, n in got[:i]) for i in range(len(got))]
        if P > 1:
            want = ref[torch.arange(P - 1), torch.tensor(prompt[1:])]
            assert torch.allclose(torch.tensor(seq.prompt_logprobs), want, atol=1e-4)
            check_top(got_pieces, ref[: P - 1])
            ranks = torch.tensor([r for p in got_pieces for r in p.ranks])
            rows = ref[: P - 1]  # a rank: 1 + the tokens likelier than it (near-ties either way)
            assert ((rows > want[:, None] + 1e-4).sum(-1) + 1 <= ranks).all()
            assert (ranks <= (rows > want[:, None] - 1e-4).sum(-1) + 1).all()
            assert [t for p in got_pieces for t in p.token_ids] == prompt[1:]
            assert all(p.k == K for p in got_pieces)
        # generated tokens: greedy = HF's argmax, logprobs and top k from the same rows
        out = seq.output_ids
        rows = ref[P - 1 : P - 1 + len(out)]
        assert out == rows.argmax(-1).tolist()
        assert torch.allclose(torch.tensor(seq.logprobs), rows.max(-1).values, atol=1e-4)
        assert [t for r in records for t in r.token_ids] == out
        assert [r.start for r in records] == list(range(P, P + len(out)))
        assert [r.finish_reason for r in records] == [None] * (len(out) - 1) + ["length"]
        check_top(records, rows)


def test_logprob_requests_leave_the_others_unchanged(hf):
    """Mixed in one batch, requests asking for nothing get the very same tokens, and nothing
    extra is computed or kept for them."""
    path, model = hf
    prompts = make_prompts(model.config.vocab_size, seed=3)[:8]
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    asking = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=True,
                            top_logprobs=2, prompt_logprobs=0)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32",
                          scheduler=SchedulerConfig(max_batched_tokens=48, max_running=16),
                          kv_cache_tokens=4096, kv_cache_dtype="float32")
    alone = build_engine(config).generate(prompts, plain)
    engine = build_engine(config)
    outputs, pieces = record_steps(engine)
    mixed = engine.generate(prompts, [plain, asking] * 4)
    assert [s.output_ids for s in mixed] == [s.output_ids for s in alone]
    for s in mixed[0::2]:
        assert s.prompt_logprobs == [] and s.request_id not in pieces
        assert all(len(r.top_ids) == 0 for r in outputs[s.request_id])
    for s in mixed[1::2]:
        assert len(s.prompt_logprobs) == s.num_prompt - 1
        assert all(p.k == 0 for p in pieces[s.request_id])  # k = 0: the token's own only
        assert len(outputs[s.request_id]) == MAX_NEW
        assert all(len(r.top_ids) == 2 for r in outputs[s.request_id])
