"""Beam search (use_beam_search): the search's pure logic, and through the engine the same
beams and scores as transformers' generate(num_beams=W) on a tiny random model: stop ids,
length penalties, every early_stopping mode, beam groups beside other requests, a tight KV
cache (preemption restarts a search), prefix caching."""

from __future__ import annotations

import pytest
import torch

from pipellm.services.compute.beam.search import BeamSearch
from pipellm.shared.sampling import InvalidParams, SamplingParams
from tests.hf_models import build_hf_model
from tests.test_architectures import engine, greedy

W, MAX_NEW = 3, 10


# --- the search alone --------------------------------------------------------------------


def row(*pairs):
    """A row's candidates from (token, probability) pairs."""
    return [t for t, _ in pairs], [float(torch.tensor(p).log()) for _, p in pairs]


def test_forks_keep_the_parents_lane_and_copy_into_free_ones():
    s = BeamSearch(2, 5, frozenset({9}))  # K = 4 candidates a row
    s.step([row((1, 0.5), (2, 0.3), (3, 0.1), (4, 0.1))])  # from the prompt, in lane 0
    assert [(b.tokens, b.lane) for b in s.running] == [((1,), 0), ((2,), 1)]
    assert s.copies == [(0, 1)]  # lane 1 gets the prompt's K/V
    # both best continuations extend beam (2,): it keeps lane 1, its second child takes lane 0
    s.step([row((5, 0.01), (6, 0.01), (7, 0.01), (8, 0.01)), row((5, 0.9), (6, 0.05), (7, 0.03),
                                                            (8, 0.02))])
    assert [(b.tokens, b.lane) for b in s.running] == [((2, 5), 1), ((2, 6), 0)]
    assert s.copies == [(1, 0)] and not s.done


def test_a_stop_id_among_the_first_w_finishes_a_hypothesis_with_its_length_penalty():
    s = BeamSearch(2, 5, frozenset({9}), length_penalty=2.0)
    s.step([row((9, 0.6), (1, 0.3), (2, 0.05), (3, 0.05))])
    [h] = s.finished
    assert h.tokens == (9,) and h.finish_reason == "stop"
    assert h.score == pytest.approx(float(torch.tensor(0.6).log()) / 1**2.0)
    assert [b.tokens for b in s.running] == [(1,), (2,)]  # the W best that go on


@pytest.mark.parametrize("early_stopping, done", [(True, True), (False, True),
                                                   ("never", False)])
def test_early_stopping_modes(early_stopping, done):
    """One hypothesis (9,) at log 0.6 and one running beam at log 0.4: True stops with W
    finished; False stops as the running beam cannot beat it at its current length; "never"
    with a positive length penalty goes on (at 50 tokens it could)."""
    s = BeamSearch(1, 50, frozenset({9}), early_stopping=early_stopping)
    s.step([row((9, 0.6), (1, 0.4))])
    assert s.done == done and [h.tokens for h in s.results(1)] == [(9,)]


def test_the_length_limit_finishes_the_best_w():
    s = BeamSearch(2, 1, frozenset({9}))
    s.step([row((1, 0.5), (2, 0.3), (3, 0.1), (4, 0.1))])
    assert s.done and [(h.tokens, h.finish_reason) for h in s.results(2)] == \
        [((1,), "length"), ((2,), "length")]


# --- against transformers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam") / "hf"
    model = build_hf_model(path, "llama", initializer_range=0.2, num_hidden_layers=2,
                           with_tokenizer=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 11, 17)]
    return path, model, prompts


def hf_beams(model, prompt, n, stop=None, **kw):
    """transformers' n best (output tokens, score) of generate(num_beams=W)."""
    out = model.generate(torch.tensor([prompt]), num_beams=W, num_return_sequences=n,
                         max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stop,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                         **kw)
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        tokens = seq[len(prompt):]
        if stop is not None and stop in tokens:  # padded after its stop id
            tokens = tokens[: tokens.index(stop) + 1]
        beams.append((tokens, score))
    return beams


def likely_stop(model, prompt, at: int = 2) -> int:
    """A token the model is likely to reach early: its greedy token number `at`."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=at, do_sample=False,
                         pad_token_id=0)
    return int(out[0, -1])


def beam_params(n, stop=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True,
                          stop_token_ids=() if stop is None else (stop,), beam_width=W,
                          beam_n=n, **kw)


def run_beams(eng, prompts, params_list, extra=()):
    """Run prompts (with `extra` plain requests beside them); each beam request's records."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
    for p, sp in extra:
        eng.add_request(p, sp)
    got = {rid: [] for rid in ids}
    while eng.has_work():
        for r in eng.step().outputs:
            if r.request_id in got:
                got[r.request_id].append(r)
    return [[(list(r.token_ids), sum(r.logprobs)) for r in got[rid]] for rid in ids]


def score(tokens, cum, penalty=1.0):
    return cum / len(tokens) ** penalty


CASES = {  # name: (the greedy token number that is the stop id (0: none), generate kwargs)
    "length": (0, {}),
    "stop": (2, {}),
    "penalty 2, early": (2, {"length_penalty": 2.0, "early_stopping": True}),
    "first token, early": (1, {"early_stopping": True}),
    "penalty 0.5, never": (2, {"length_penalty": 0.5, "early_stopping": "never"}),
    "penalty -1": (2, {"length_penalty": -1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_beams_and_scores_as_transformers(tiny, case):
    path, model, prompts = tiny
    at, kw = CASES[case]
    stops = [likely_stop(model, p, at) if at else None for p in prompts]
    # chunks beside beam rows, under the overlap schedule
    eng = engine(path, max_batched_tokens=16, max_running=8, overlap_schedule="on")
    got = run_beams(eng, prompts, [beam_params(W, s, **kw) for s in stops],
                    extra=[(prompts[0][:3], greedy(6))])
    penalty = kw.get("length_penalty", 1.0)
    for prompt, stop, beams in zip(prompts, stops, got, strict=True):
        want = hf_beams(model, prompt, W, stop, **kw)
        assert [t for t, _ in beams] == [t for t, _ in want]
        assert [score(t, c, penalty) for t, c in beams] == \
            pytest.approx([s for _, s in want], abs=1e-4)
    assert eng.kv.allocator.reserved == 0  # every lane freed


def test_n_best_of_w_and_finish_reasons(tiny):
    path, model, prompts = tiny
    stop = likely_stop(model, prompts[1])
    [beams] = run_beams(engine(path), [prompts[1]], [beam_params(2, stop)])
    want = hf_beams(model, prompts[1], 2, stop)
    assert [t for t, _ in beams] == [t for t, _ in want]


def test_preemption_restarts_the_search_with_the_same_result(tiny):
    path, model, prompts = tiny
    params = beam_params(W)
    want = run_beams(engine(path), [prompts[2]], [params])
    # a plain request predicted to be short, then the beam group right after its segment:
    # when the plain one outgrows its segment, its neighbour (the beams) is preempted
    lanes = W * (len(prompts[2]) + MAX_NEW)
    eng = engine(path, kv_cache_tokens=len(prompts[1]) + 2 + lanes + 2, default_predicted_len=2)
    eng.add_request(prompts[1], greedy(8))
    assert run_beams(eng, [prompts[2]], [params]) == want
    assert eng.stats().preemptions >= 1


def test_prefix_cache_serves_a_beam_request_and_keeps_its_prompt(tiny):
    path, model, prompts = tiny
    params = beam_params(W)
    want = run_beams(engine(path), [prompts[2]], [params])
    eng = engine(path, enable_prefix_caching=True)
    first = run_beams(eng, [prompts[2]], [params])
    again = run_beams(eng, [prompts[2]], [params])
    for got in (first, again):  # a prefix hit computes the prompt in other chunks: last bits
        assert [t for t, _ in got[0]] == [t for t, _ in want[0]]
        assert [c for _, c in got[0]] == pytest.approx([c for _, c in want[0]], abs=1e-4)
    assert eng.stats().prefix_hits == len(prompts[2]) - 1


def test_beam_search_refuses_what_it_cannot_follow(tiny):
    path, _, prompts = tiny
    eng = engine(path)
    with pytest.raises(InvalidParams, match="resumed"):
        eng.add_request(prompts[0], beam_params(W), output_ids=[5])
    sim = engine(path, backend="sim")
    with pytest.raises(InvalidParams, match="simulated"):
        sim.add_request(prompts[0], beam_params(W))
    with pytest.raises(InvalidParams):
        SamplingParams(beam_width=2, beam_n=3)
    with pytest.raises(InvalidParams, match="early_stopping"):
        SamplingParams(beam_width=2, early_stopping="sometimes")


# --- through the services ------------------------------------------------------------------


def test_served_with_the_official_client(demo_model_dir):
    """`pipellm up` (real processes, real Redis): use_beam_search with n and best_of gives
    the engine's n best beams as choices, on completions and chat; streaming it, or with a
    a grammar, is a 400 that says why, and the server carries on."""
    import openai

    from pipellm.services.compute.backend import build_engine
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.tokenizer import decode, encode, load_tokenizer
    from tests.stack import Stack

    prompt = "The capital of France is"
    tok = load_tokenizer(demo_model_dir)
    eng = build_engine(EngineConfig(model=str(demo_model_dir), device="cpu",
                                    kv_cache_tokens=4096))
    params = SamplingParams(max_tokens=12, beam_width=3, beam_n=2)
    beams = run_beams(eng, [encode(tok, prompt)], [params])[0]
    want = [decode(tok, t) for t, _ in beams]
    stack = Stack(demo_model_dir).start()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        beam = {"use_beam_search": True}
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, n=2,
                                      best_of=3, extra_body=beam)
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
        assert r.usage.completion_tokens == sum(len(t) for t, _ in beams)
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2,
            extra_body={**beam, "length_penalty": 0.5, "early_stopping": "never"})
        assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
        for extra, param in (({"stream": True}, "stream"),
                             ({"guided_regex": "[a-z]+"}, "use_beam_search"),
                             ({"early_stopping": "soon"}, "early_stopping")):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                          extra_body={**beam, **extra})
            assert e.value.body["param"] == param
        again = client.completions.create(model=model, prompt=prompt, max_tokens=12, n=2,
                                          best_of=3, extra_body=beam)
        assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == want
    finally:
        stack.stop()
