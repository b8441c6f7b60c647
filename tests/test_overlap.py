"""The overlap schedule (step N+1 scheduled and launched before step N is committed) against the
plain one: the same tokens, logprobs and finishes for every request, with stops, length limits,
penalties, preemptions, KV moves and aborts while a step is in flight; and the scheduler's
advance/commit ordering without a model."""

from __future__ import annotations

import pytest

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.core.sequence import UNSAMPLED, SeqStatus, Sequence
from pipellm.services.compute.core.step import StepSample
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.scheduler import Scheduler
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams
from tests.steps import chunks, decodes

PROMPTS = [[1, 5, 9, 200], [1, 77], [1] + [3] * 30 + [400], [1, 8, 8], [1, 2, 3, 4, 5, 6, 7],
           [1, 300, 301, 302, 303], [1, 42]]


def _params(stop_ids: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=33, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True,
                       logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=stop_ids[:1],
                       prompt_logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.7, seed=9, stop_token_ids=stop_ids,
                       min_tokens=3, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, seed=3, presence_penalty=0.5,
                       frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
    ]


def _engine(model_dir, overlap: str, tokens: int = 4096):
    return build_engine(EngineConfig(model=str(model_dir), device="cpu",
                                     scheduler=SchedulerConfig(max_batched_tokens=24,
                                                               max_running=8, kv_min_grow=4),
                                     kv_cache_tokens=tokens, default_predicted_len=4,
                                     overlap_schedule=overlap))


def _run(engine, params, abort_at: dict[int, int] | None = None) -> dict:
    """Every request's stream: (token, logprob, finish_reason, top) events and prompt pieces.
    abort_at: {request index: step at which it is aborted}. A logprob is compared only where
    asked for (elsewhere it depends on whether another row of the step asked)."""
    rids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    asked = {r: sp.logprobs for r, sp in zip(rids, params, strict=True)}
    streams = {r: {"events": [], "prompt": []} for r in rids}
    step = 0
    while engine.has_work():
        for i, at in (abort_at or {}).items():
            if at == step:
                engine.abort(rids[i])
        result = engine.step()
        for e in result.outputs:
            assert not streams[e.request_id]["events"] or \
                streams[e.request_id]["events"][-1][2] is None, "an event after the finish"
            streams[e.request_id]["events"].append(
                (e.token_ids[0], e.logprobs[0] if asked[e.request_id] else None,
                 e.finish_reason, (list(e.top_ids), list(e.top_logprobs))))
        for piece in result.prompt:
            streams[piece.request_id]["prompt"].append((piece.start, list(piece.logprobs)))
        step += 1
    assert engine.stats().reserved == 0 and not engine.requests
    return [streams[r] for r in rids]


@pytest.fixture(scope="module")
def stop_ids(demo_model_dir) -> list[int]:
    """Tokens request 2 and 3 do generate, so that their stops are hit mid-way."""
    out = _engine(demo_model_dir, "off").generate(PROMPTS[2:4], SamplingParams(
        max_tokens=20, temperature=0, ignore_eos=True))
    return [out[0].output_ids[6], out[1].output_ids[9]]


@pytest.mark.parametrize("kv_tokens", [4096, 150], ids=["roomy", "preempting"])
def test_overlap_gives_every_request_the_same_stream(demo_model_dir, stop_ids, kv_tokens):
    params = _params(stop_ids)
    plain, overlapped = (_engine(demo_model_dir, mode, kv_tokens) for mode in ("off", "on"))
    assert overlapped.overlap and not plain.overlap
    want, got = _run(plain, params), _run(overlapped, params)
    assert got == want
    finishes = [s["events"][-1][2] for s in want]
    assert "stop" in finishes and "length" in finishes  # both kinds were exercised
    if kv_tokens == 150:
        assert overlapped.scheduler.stats.preemptions > 0
        assert overlapped.kv.stats.moves + overlapped.scheduler.stats.preemptions > 0


def test_aborts_while_a_step_is_in_flight(demo_model_dir, stop_ids):
    params = _params(stop_ids)
    abort_at = {0: 3, 4: 5, 6: 0}
    want = _run(_engine(demo_model_dir, "off"), params, abort_at)
    got = _run(_engine(demo_model_dir, "on"), params, abort_at)
    for i in (1, 2, 3, 5):  # the others are untouched
        assert got[i] == want[i]
    for i in abort_at:  # an aborted stream is a prefix of its plain run, never finished
        full = _run_one(demo_model_dir, i, params)
        tokens = [e[0] for e in got[i]["events"]]
        assert tokens == full[: len(tokens)]
        assert all(e[2] is None for e in got[i]["events"])


def _run_one(model_dir, i: int, params) -> list:
    engine = _engine(model_dir, "off")
    seq = engine.generate([PROMPTS[i]], params[i])[0]
    return seq.output_ids


def test_generate_returns_no_unsampled_tokens(demo_model_dir, stop_ids):
    engine = _engine(demo_model_dir, "on", 150)
    seqs = engine.generate(PROMPTS, _params(stop_ids))
    for seq in seqs:
        assert UNSAMPLED not in seq.token_ids and seq.status is SeqStatus.FINISHED
        assert len(seq.logprobs) == seq.num_output


# -- the scheduler alone -----------------------------------------------------------------------

def _seq(rid: str, prompt: int, max_tokens: int, stop=frozenset()) -> Sequence:
    return Sequence(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                    seed=0, max_len=prompt + max_tokens, predicted_length=LengthDist.point(8),
                    stop_ids=frozenset(stop))


def test_scheduler_runs_ahead_of_the_tokens_and_drops_what_a_stop_made_moot():
    config = SchedulerConfig(max_batched_tokens=64, max_running=4)
    s = Scheduler(config, KVSpace(config, 256))
    a, b = _seq("a", 5, 10, stop={99}), _seq("b", 3, 2)
    s.add(a)
    s.add(b)
    first = s.schedule()
    s.advance(first)
    assert a.token_ids[-1] == UNSAMPLED and a.pending == 1  # runs again before its value is in
    second = s.schedule()
    assert decodes(second) == [a, b]
    s.advance(second)
    assert b.at_limit  # b's second token is its last: no third step for it
    third = s.schedule()
    assert decodes(third) == [a]
    s.commit(first, StepSample.of(first, [7, 8]))
    assert a.token_ids[5:] == [7, UNSAMPLED] and b.token_ids[3:] == [8, UNSAMPLED]
    s.advance(third)
    done = s.commit(second, StepSample.of(second, [99, 4]))  # a stops, b reaches max_tokens
    assert [(t.request_id, t.start, t.finish_reason) for t in done.outputs] == [
        ("a", 6, "stop"), ("b", 4, "length")]  # (the tokens' places in token_ids)
    assert a.output_ids == [7, 99] and b.output_ids == [8, 4]  # a's third token is dropped
    assert s.commit(third, StepSample.of(third, [5])).outputs == []
    assert not s.has_work() and s.kv.allocator.reserved == 0


def test_a_request_preempted_with_a_step_in_flight_gets_its_token_then_resumes():
    config = SchedulerConfig(max_batched_tokens=64, max_running=4, kv_min_grow=1)
    s = Scheduler(config, KVSpace(config, 256))
    a = _seq("a", 4, 6)
    s.add(a)
    step = s.schedule()
    s.advance(step)
    s._preempt(a)  # as the next schedule() would under memory pressure
    assert a.status is SeqStatus.WAITING and a.token_ids[-1] == UNSAMPLED
    s.commit(step, StepSample.of(step, [9]))
    assert a.token_ids == [1, 2, 3, 4, 9] and a.status is SeqStatus.WAITING
    again = s.schedule()
    assert chunks(again) == [(a, 5)]  # recomputes prompt + the token, then samples the next


def test_a_request_finished_while_preempted_leaves_the_queue():
    config = SchedulerConfig(max_batched_tokens=64, max_running=4)
    s = Scheduler(config, KVSpace(config, 256))
    a = _seq("a", 4, 6, stop={9})
    s.add(a)
    step = s.schedule()
    s.advance(step)
    s._preempt(a)
    s.commit(step, StepSample.of(step, [9]))
    assert a.finish_reason == "stop" and a.status is SeqStatus.FINISHED
    assert not s.waiting and not s.has_work()


def test_sim_backend_runs_with_the_overlap_schedule(demo_model_dir):
    config = EngineConfig(model=str(demo_model_dir), backend="sim", overlap_schedule="on",
                          kv_cache_tokens=2048)
    engine = build_engine(config)
    seqs = engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [s.num_output for s in seqs] == [16] * 4
