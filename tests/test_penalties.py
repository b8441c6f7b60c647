"""Presence / frequency / repetition penalties: the kernel, its token statistics, the engine."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pipellm.kernels.sampling import SamplingBatch, apply_penalties, sample, token_stats
from pipellm.services.compute.backend import build_engine
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.sampling import InvalidParams, SamplingParams

F32, I64 = torch.float32, torch.int64


def random_case(seed: int, rows: int = 6, vocab: int = 50):
    """Random nonzero logits (both signs) and random prompts/outputs with repeats."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits = torch.where(logits.abs() < 1e-3, 0.5, logits)  # never zero: the sign matters
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab // 3) for _ in range(rng.randrange(0, 20))]
               for _ in range(rows)]
    presence = [rng.uniform(-2, 2) for _ in range(rows)]
    frequency = [rng.uniform(-2, 2) for _ in range(rows)]
    repetition = [rng.choice([0.5, 1.0, 1.3, 2.0]) for _ in range(rows)]
    return logits, prompts, outputs, presence, frequency, repetition


def reference(logits, prompts, outputs, presence, frequency, repetition) -> torch.Tensor:
    """Per-row, per-token Python version of the vLLM rule."""
    out = logits.clone().double()
    for r in range(logits.shape[0]):
        seen = set(prompts[r]) | set(outputs[r])
        for v in range(logits.shape[1]):
            x = float(logits[r, v])
            if v in seen:
                x = x / repetition[r] if x > 0 else x * repetition[r]
            count = outputs[r].count(v)
            x -= frequency[r] * count
            x -= presence[r] * (count > 0)
            out[r, v] = x
    return out


def penalize(logits, prompts, outputs, presence, frequency, repetition):
    mask, counts = token_stats(prompts, outputs, logits.shape[1], "cpu")
    return apply_penalties(logits, mask, counts, torch.tensor(presence, dtype=F32),
                           torch.tensor(frequency, dtype=F32), torch.tensor(repetition, dtype=F32))


@pytest.mark.parametrize("seed", range(5))
def test_apply_penalties_matches_reference(seed):
    case = random_case(seed)
    got = penalize(*case)
    want = reference(*case)
    assert got.dtype == F32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, case[0])  # the case really penalized something


def test_apply_penalties_does_not_modify_its_input():
    logits, *rest = random_case(11)
    before = logits.clone()
    penalize(logits, *rest)
    assert torch.equal(logits, before)


def test_neutral_values_change_nothing():
    logits, prompts, outputs, *_ = random_case(3)
    logits[0, 4] = float("-inf")  # a suppressed token stays suppressed
    rows = logits.shape[0]
    got = penalize(logits, prompts, outputs, [0.0] * rows, [0.0] * rows, [1.0] * rows)
    assert torch.equal(got, logits)


def test_each_penalty_alone():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 3.0]])
    prompts, outputs = [[0, 1]], [[2, 2, 3]]
    rep = penalize(logits, prompts, outputs, [0.0], [0.0], [2.0])
    assert rep.tolist() == [[1.0, -4.0, 0.5, -2.0, 3.0]]
    freq = penalize(logits, prompts, outputs, [0.0], [0.5], [1.0])
    assert freq.tolist() == [[2.0, -2.0, 0.0, -1.5, 3.0]]
    pres = penalize(logits, prompts, outputs, [0.25], [0.0], [1.0])
    assert pres.tolist() == [[2.0, -2.0, 0.75, -1.25, 3.0]]


def test_token_stats_counts_and_masks():
    prompts = [[0, 3, 3], [], [4]]
    outputs = [[1, 1, 1, 4], [2], []]
    mask, counts = token_stats(prompts, outputs, 5, torch.device("cpu"))
    assert mask.dtype == torch.bool and mask.shape == (3, 5)
    assert counts.shape == (3, 5) and not counts.dtype.is_floating_point
    assert mask.tolist() == [[True, False, False, True, False], [False] * 5,
                             [False, False, False, False, True]]
    assert counts.tolist() == [[0, 3, 0, 0, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    mask, counts = token_stats([[], []], [[], []], 7, "cpu")  # all empty: still well formed
    assert mask.shape == counts.shape == (2, 7) and not mask.any() and not counts.any()


def test_token_stats_random_against_python():
    rng = random.Random(5)
    vocab = 30
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(40))] for _ in range(9)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(40))] for _ in range(9)]
    mask, counts = token_stats(prompts, outputs, vocab, "cpu")
    for r in range(9):
        assert mask[r].tolist() == [v in prompts[r] for v in range(vocab)]
        assert counts[r].tolist() == [outputs[r].count(v) for v in range(vocab)]


def test_sample_chooses_from_penalized_but_reports_raw_logprobs():
    raw = torch.tensor([[3.0, 2.9, 0.1], [0.5, 1.0, 0.2]])
    penalized = raw.clone()
    penalized[0, 0] = -5.0  # row 0: the raw favourite is penalized away
    b = raw.shape[0]
    zeros = torch.zeros(b, dtype=I64)
    params = dict(temperature=torch.zeros(b), top_p=torch.ones(b), min_p=torch.zeros(b),
                  top_k=zeros, seeds=zeros, steps=zeros)
    for all_greedy in (True, False):
        ids, lps = sample(penalized, SamplingBatch(**params, all_greedy=all_greedy), raw)
        assert ids.tolist() == [1, 1]
        want = raw.log_softmax(-1).gather(1, ids[:, None])[:, 0]
        torch.testing.assert_close(lps, want)
    ids, lps = sample(penalized, SamplingBatch(**params))  # without raw_logits: from `penalized`
    torch.testing.assert_close(lps, penalized.log_softmax(-1).gather(1, ids[:, None])[:, 0])


# ---- through the engine --------------------------------------------------------------------

PROMPT = [1, 3, 3, 3, 3, 3, 3, 3, 3, 400, 17, 17, 17]
OTHER = [1, 5, 9, 200, 41]


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return build_engine(EngineConfig(model=str(demo_model_dir), device="cpu", dtype="float32",
                                     kv_cache_dtype="float32",
                                     scheduler=SchedulerConfig(max_batched_tokens=64,
                                                               max_running=8),
                                     kv_cache_tokens=4096))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, **kw)


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_reduce_repetition(engine):
    plain = engine.generate([PROMPT], greedy())[0].output_ids
    assert repeats(plain) > 5  # the random demo model loops without penalties
    for kw in ({"frequency_penalty": 2.0}, {"repetition_penalty": 3.0},
               {"presence_penalty": 2.0, "frequency_penalty": 1.0}):
        out = engine.generate([PROMPT], greedy(**kw))[0].output_ids
        assert len(out) == 32
        assert repeats(out) < repeats(plain), kw


def test_row_without_penalties_is_unchanged_in_a_penalized_batch(engine):
    alone = engine.generate([OTHER], greedy())[0]
    alone_sampled = engine.generate([OTHER], SamplingParams(
        max_tokens=32, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True))[0]
    mixed = engine.generate(
        [PROMPT, OTHER, PROMPT, OTHER],
        [greedy(frequency_penalty=2.0), greedy(),
         SamplingParams(max_tokens=32, temperature=0.9, repetition_penalty=2.0, seed=1,
                        ignore_eos=True),
         SamplingParams(max_tokens=32, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)])
    assert mixed[1].output_ids == alone.output_ids
    assert mixed[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert mixed[3].output_ids == alone_sampled.output_ids
    assert mixed[0].output_ids == engine.generate([PROMPT], greedy(
        frequency_penalty=2.0))[0].output_ids  # penalized rows are batch-independent too


def test_matches_hf_repetition_penalty_and_logprobs_stay_raw(engine, demo_model_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(demo_model_dir).eval()
    seq = engine.generate([PROMPT], greedy(repetition_penalty=1.8, logprobs=True))[0]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False, repetition_penalty=1.8, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert seq.output_ids == gen.sequences[0, len(PROMPT):].tolist()
    raw = torch.stack(gen.logits, dim=1)[0].float().log_softmax(-1)  # [32, V], pre-penalty
    want = raw.gather(1, torch.tensor(seq.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(seq.logprobs), want, rtol=0, atol=1e-4)
    plain = engine.generate([PROMPT], greedy())[0].output_ids
    assert plain != seq.output_ids  # the penalty mattered for this prompt


def test_repetition_covers_the_prompt_but_frequency_and_presence_only_the_output(engine):
    plain = engine.generate([PROMPT], greedy())[0].output_ids
    looped = PROMPT + plain[:8]  # the demo model is in a loop here: its next pick is a prompt token
    one = dict(max_tokens=1, temperature=0, ignore_eos=True)
    nxt = engine.generate([looped], SamplingParams(**one))[0].output_ids[0]
    assert nxt in looped
    rep = engine.generate([looped], SamplingParams(repetition_penalty=3.0, **one))[0]
    assert rep.output_ids[0] not in looped
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        out = engine.generate([looped], SamplingParams(**one, **kw))[0].output_ids
        assert out == [nxt], kw  # nothing generated yet: output-only penalties do nothing


def test_logit_bias_forces_and_bans_tokens_and_leaves_other_rows_alone(engine):
    plain = engine.generate([OTHER], greedy(logprobs=True))[0]
    forced, banned, other, mixed_bias = engine.generate(
        [PROMPT, OTHER, OTHER, OTHER],
        [greedy(logit_bias=((777, 100.0),), logprobs=True),
         greedy(logit_bias=((plain.output_ids[0], -100.0),)),
         greedy(logprobs=True),
         greedy(logit_bias=((777, 100.0), (plain.output_ids[0], -100.0), (777, -100.0)))])
    assert forced.output_ids == [777] * 32
    assert banned.output_ids[0] != plain.output_ids[0]
    assert plain.output_ids[0] not in banned.output_ids
    assert other.output_ids == plain.output_ids  # its neighbours' biases do not leak
    assert other.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    assert 777 not in mixed_bias.output_ids[:1]  # +100 and -100 on one token add up to 0
    # logprobs stay the model's: the forced token's are its own (low) probability
    assert max(forced.logprobs) < -1.0


def test_logit_bias_is_validated(engine):
    with pytest.raises(InvalidParams, match="logit_bias"):
        SamplingParams(logit_bias=((5, 101.0),))
    with pytest.raises(InvalidParams, match="logit_bias"):
        engine.add_request([1, 2], greedy(logit_bias=((10**6, 1.0),)))


def test_banned_tokens_against_a_python_reference():
    """allowed_token_ids leaves only those; a bad word's last token is banned where the output
    ends with the rest of the word; other rows are left as they are; logits are not modified."""
    from pipellm.services.compute.core.sequence import Sequence
    from pipellm.services.compute.sampling import _ban_tokens
    from pipellm.shared.length_dist import LengthDist

    def seq(output, **params):
        return Sequence("r", [1, 2] + output, SamplingParams(**params), seed=0, max_len=64,
                        predicted_length=LengthDist.point(4), stop_ids=frozenset(), num_prompt=2)

    rows = [seq([5, 6], allowed_token_ids=(3, 7)), seq([5, 6], bad_words_ids=((6, 9), (4,))),
            seq([5, 8], bad_words_ids=((6, 9), (5, 8, 2))), seq([5, 6])]
    logits = torch.randn(4, 12)
    out = _ban_tokens(logits, rows)
    want = logits.clone()
    want[0, [i for i in range(12) if i not in (3, 7)]] = float("-inf")
    want[1, [9, 4]] = float("-inf")
    want[2, 2] = float("-inf")
    torch.testing.assert_close(out, want)
    assert torch.isfinite(logits).all()
    assert SamplingParams(bad_words_ids=((1,),)).reads_output
    assert not SamplingParams(allowed_token_ids=(1,)).reads_output
