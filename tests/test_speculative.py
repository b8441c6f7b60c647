"""Speculative decoding with n-gram (prompt lookup) drafts: the proposer, the config, and
through the engine the same tokens as plain decoding (greedy and seeded), with chunked
prefill, preemption and prefix caching; the verification rule keeps the target distribution
(chi-square over seeded draws); through the real services with the official client."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.speculative.ngram import NgramProposer
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.speculative import SpeculativeConfig
from tests.hf_models import build_hf_model
from tests.test_architectures import engine, greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 64}  # speculating in every batch
SPEC = json.dumps(NGRAM)


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(max_tokens=100), 0, 1000,
                    LengthDist.point(10), frozenset())


# --- the proposer and the config ----------------------------------------------------------


def test_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(SpeculativeConfig(3, 1, 3))
    #                   0  1  2  3  4  5  6  7  8  9
    s = seq_of([7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    assert p.propose(s, 10) == [4, 5, 1]  # (1, 2) last seen at 5..6, followed by 4 5 1
    assert p.propose(s, 2) == [4, 5]  # the limit
    s.token_ids.append(3)  # now (1, 2, 3) occurs at 1..3: the longest match wins
    assert p.propose(s, 10) == [9, 1, 2]
    assert p.propose(seq_of([1, 2, 3, 4]), 10) == []  # no earlier occurrence
    s.token_ids[:] = [5, 6, 5]  # cut back (a new request in the same object): index rebuilt
    assert p.propose(s, 10) == [6, 5]


def test_poor_verifies_back_off_doubling_and_a_good_one_resets():
    p = NgramProposer(SpeculativeConfig(3, 1, 3))
    s = seq_of([1, 2, 3, 1, 2])
    assert p.propose(s, 10) == [3, 1, 2]
    p.verified(s, 3, 1)  # poor: 2 steps without proposals
    assert [p.propose(s, 10) for _ in range(3)] == [[], [], [3, 1, 2]]
    p.verified(s, 3, 0)  # poor again: 4 steps
    assert [p.propose(s, 10) for _ in range(5)] == [[]] * 4 + [[3, 1, 2]]
    p.verified(s, 3, 2)  # good: the count resets
    p.verified(s, 3, 0)
    assert [p.propose(s, 10) for _ in range(3)] == [[], [], [3, 1, 2]]


@pytest.mark.parametrize(("text", "needle"), [
    ('{"num_speculative_tokens": 0}', "'num_speculative_tokens' must be a positive integer"),
    ("{}", "'num_speculative_tokens'"),
    ('{"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min must be <="),
    ('{"num_speculative_tokens": 3, "lookahead": 1}', "unknown key 'lookahead'"),
    ("[3]", "JSON object"),
])
def test_bad_configs_name_the_key(text, needle):
    with pytest.raises(ValueError, match=needle):
        SpeculativeConfig.parse(text)


# --- through the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama and prompts that repeat themselves (so that lookup finds drafts)."""
    path = tmp_path_factory.mktemp("spec")
    build_hf_model(path, "llama", initializer_range=0.1, num_hidden_layers=2)
    rng = random.Random(0)
    prompts = []
    for n in (3, 20, 60, 150, 9, 40):
        base = [rng.randrange(3, 500) for _ in range(n)]
        prompts.append(base * 3)
    return path, prompts


def run(path, prompts, params, **settings):
    eng = engine(path, kv_cache_tokens=settings.pop("kv_cache_tokens", 8192), **settings)
    return [s.output_ids for s in eng.generate(prompts, params)], eng.stats()


@pytest.mark.parametrize("settings", [
    dict(max_batched_tokens=64, max_running=8),  # chunked prefill beside verifies
    dict(max_batched_tokens=64, max_running=8, kv_cache_tokens=700, default_predicted_len=2,
         kv_min_grow=4),  # preemption
    dict(max_batched_tokens=512, max_running=8, enable_prefix_caching=True),
    dict(max_batched_tokens=64, max_running=8, kv_cache_dtype="int8"),
], ids=["chunked", "preempted", "prefix-cached", "int8-kv"])
def test_greedy_tokens_equal_plain_decoding(tiny, settings):
    path, prompts = tiny
    want, _ = run(path, prompts, greedy(40), **settings)
    got, stats = run(path, prompts, greedy(40), speculative_config=SPEC, **settings)
    assert got == want
    assert stats.spec_draft_tokens > 0 and 0 < stats.spec_accepted_tokens <= \
        stats.spec_draft_tokens
    if "kv_cache_tokens" in settings:
        assert stats.preemptions > 0


@pytest.mark.parametrize(("limit", "speculates"), [(1, False), (2, True)])
def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(tiny, limit, speculates):
    path, prompts = tiny
    spec = json.dumps({**NGRAM, "disable_by_batch_size": limit})
    got, stats = run(path, prompts[2:4], greedy(20), speculative_config=spec)
    assert got == run(path, prompts[2:4], greedy(20))[0]
    assert (stats.spec_draft_tokens > 0) == speculates


def test_stop_tokens_inside_a_verify_with_prefix_caching(tiny):
    """Requests that stop on a token inside a verify end there, their KV kept by the prefix
    cache as a plain decode's (not the slot of a rejected draft): then prompts that extend
    their whole sequences hit the cache and generate the same tokens as plain decoding."""
    from collections import Counter

    path, prompts = tiny
    plain, _ = run(path, prompts, greedy(40))
    stop = Counter(t for out in plain for t in out[5:30]).most_common(1)[0][0]
    settings = dict(kv_cache_tokens=8192, max_batched_tokens=512, max_running=8,
                    enable_prefix_caching=True)
    plain_eng, spec_eng = engine(path, **settings), engine(path, speculative_config=SPEC,
                                                           **settings)
    params = greedy(40, stop_token_ids=[stop], logprobs=True)
    for _ in range(2):
        want = plain_eng.generate(prompts, params)
        got = spec_eng.generate(prompts, params)
        assert [s.output_ids for s in got] == [s.output_ids for s in want]
        torch.testing.assert_close(torch.tensor([x for s in got for x in s.logprobs]),
                                   torch.tensor([x for s in want for x in s.logprobs]),
                                   atol=1e-5, rtol=0)
        prompts = [s.token_ids + [11, 12] for s in got]  # whole sequences, extended
    assert sum(s.output_ids[-1] == stop for s in got) >= 2
    assert spec_eng.stats().prefix_hits > 0 and spec_eng.stats().spec_accepted_tokens > 0


def test_seeded_sampling_draws_what_plain_decoding_draws(tiny):
    """Each verified row samples with the seed and step counter of its output index: a
    seeded request gets the tokens it gets without speculation (and stops where they stop)."""
    path, prompts = tiny
    params = [SamplingParams(max_tokens=30, temperature=t, top_p=0.9, seed=s, logprobs=1)
              for s, t in zip(range(len(prompts)), (0.3, 0.6, 1.0, 0.3, 0.6, 1.0), strict=True)]
    want, _ = run(path, prompts, params, max_batched_tokens=64, max_running=8)
    got, stats = run(path, prompts, params, max_batched_tokens=64, max_running=8,
                     speculative_config=SPEC)
    assert got == want and stats.spec_accepted_tokens > 0


def test_limits_and_logprobs_hold_under_speculation(tiny):
    """max_tokens is never exceeded by accepted drafts; the logprobs of the accepted tokens
    are those plain decoding reports."""
    path, prompts = tiny
    params = greedy(7, logprobs=True)
    want = engine(path, kv_cache_tokens=4096).generate(prompts, params)
    got = engine(path, kv_cache_tokens=4096, speculative_config=SPEC).generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids and len(g.output_ids) == 7
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                   atol=1e-4, rtol=0)


def test_verification_keeps_the_target_distribution():
    """The rule: sample the row as plain decoding would; the draft d is accepted when the
    sample is d. Over many seeded draws on a 6-token vocabulary the emitted token follows the
    target's probabilities (chi-square, 5 degrees of freedom, p > 0.001) and d is accepted
    with probability p(d)."""
    from pipellm.kernels import SamplingBatch, sample

    logits = torch.tensor([[1.2, 0.3, -0.5, 2.0, 0.0, -1.0]])
    p = torch.softmax(logits[0], -1)
    n, draft = 20000, 0
    rows = logits.expand(n, -1).contiguous()
    batch = SamplingBatch(temperature=torch.ones(n), top_p=torch.ones(n), min_p=torch.zeros(n),
                          top_k=torch.zeros(n, dtype=torch.long), seeds=torch.arange(n),
                          steps=torch.full((n,), 3), all_greedy=False, need_sort=False,
                          need_logprobs=False)
    tokens, _ = sample(rows, batch)
    counts = torch.bincount(tokens, minlength=6).double()
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum().item()
    assert chi2 < 20.5, (chi2, counts / n, p)  # the 0.999 quantile of chi-square(5)
    accepted = (tokens == draft).double().mean().item()
    assert abs(accepted - p[draft].item()) < 4 * (p[draft] * (1 - p[draft]) / n).sqrt().item()


def test_served_with_the_official_client_and_metrics(demo_model_dir):
    """`pipellm up --speculative-config ...` (real processes, real Redis): greedy completions,
    streamed and not, equal the plain engine's text; /metrics counts drafts and accepted ones
    under vLLM's names."""
    values = served_equals_plain(
        demo_model_dir, SPEC,
        "one two three four five six seven. one two three four five six seven. one two")
    drafts = values["vllm:spec_decode_num_draft_tokens_total"]
    assert drafts > 0 and 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= drafts


def served_equals_plain(model_dir, spec: str, prompt: str) -> dict[str, float]:
    """Through `pipellm up --speculative-config spec` with the official client: a greedy
    completion of 24 tokens, streamed and not, has the plain in-process engine's text; returns
    /metrics' values (spec_metrics)."""
    import openai

    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.tokenizer import decode, encode, load_tokenizer
    from tests.stack import Stack

    tok = load_tokenizer(model_dir)
    plain = build_engine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_tokens=4096))
    want = decode(tok, plain.generate([encode(tok, prompt)], greedy(24))[0].output_ids)
    stack = Stack(model_dir, "--speculative-config", spec).start()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=24,
                  temperature=0, extra_body={"ignore_eos": True})
        r = client.completions.create(**kw)
        assert r.choices[0].text == want and r.usage.completion_tokens == 24
        chunks = list(client.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        return spec_metrics(stack)
    finally:
        stack.stop()


def spec_metrics(stack) -> dict[str, float]:
    """/metrics' values once they count drafts (compute publishes its stats every
    heartbeat), or after 10 s."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 10
    while True:
        status, text = stack.get("/metrics")
        assert status == 200
        values = {s.name: s.value for f in text_string_to_metric_families(text)
                  for s in f.samples}
        if values["vllm:spec_decode_num_draft_tokens_total"] > 0 or \
                time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def test_smollm2_copying_a_text_is_token_exact_and_accepts_drafts():
    """The reference model (its Q4 blocks, INT8 activations: any last-bit difference from
    plain decoding would flip near-ties) asked to repeat a text (the input-grounded case
    speculation is for): the same greedy tokens as plain decoding, most drafts accepted."""
    from pipellm.shared import default_model
    from pipellm.shared.chat_template import load_chat_template
    from pipellm.shared.tokenizer import load_tokenizer

    path = default_model.fetch()
    tok, template = load_tokenizer(path), load_chat_template(path)
    text = ("Speculative decoding proposes several tokens and checks them in one forward "
            "pass of the model, keeping those the model would have produced itself.")
    ask = f"Copy the following text exactly:\n\n{text}"  # copied under W4A8 and W4A16 alike
    prompts = [template.encode(tok, [{"role": "user", "content": ask}])]
    spec = json.dumps({**NGRAM, "prompt_lookup_min": 2})
    want, _ = run(path, prompts, greedy(32), max_batched_tokens=256, max_running=4)
    got, stats = run(path, prompts, greedy(32), max_batched_tokens=256, max_running=4,
                     speculative_config=spec)
    assert got == want
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens / 2, stats
