"""Prefix caching in the scheduler, as pure logic: which K/V copies a hit schedules, what stays
cached, what is evicted and when. (Token-exact outputs: tests/test_engine_prefix.py.)"""

from __future__ import annotations

import random

import pytest

from pipellm.services.compute.core.sequence import SeqStatus, Sequence
from pipellm.services.compute.core.step import StepSample
from pipellm.services.compute.kv.allocator import KVAllocator
from pipellm.services.compute.scheduling.kv_space import KVSpace
from pipellm.services.compute.scheduling.scheduler import Scheduler
from pipellm.shared.config import SchedulerConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams
from tests.steps import chunks, decodes


def seq(rid: str, prompt: list[int], max_tokens: int = 4, predicted: int = 4, **kw) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
    return Sequence(rid, list(prompt), params, seed=0, max_len=len(prompt) + max_tokens,
                    predicted_length=LengthDist.point(predicted), stop_ids=frozenset())


def make(capacity=1000, budget=64, policy="predicted", caching=True) -> Scheduler:
    config = SchedulerConfig(budget, 8, policy, 2, enable_prefix_caching=caching)
    return Scheduler(config, KVSpace(config, capacity))


def run(s: Scheduler, token: int = 900) -> list:
    """Steps until idle; the moves of every step."""
    moves = []
    while s.has_work():
        step = s.schedule()
        moves += step.moves
        n = len(step.sampled)
        s.update(step, StepSample.of(step, [token] * n))
        s.kv.allocator.check()
        assert s.kv.allocator.reserved == sum(x.kv_reserved for x in s.kv.segments(s.running))
    return moves


def test_a_finished_request_stays_cached_and_a_longer_prompt_copies_its_prefix():
    s = make()
    a = seq("a", range(1, 21))
    s.add(a)
    run(s)
    cache = s.kv.prefix_cache
    assert cache.entries() == [a] and a.kv_reserved == a.num_cached == 23  # 20 + 3 with K/V
    assert cache.slots == 23 and s.kv.allocator.reserved == 23
    b = seq("b", [*a.token_ids, 50, 51])  # a's whole conversation, then a new question
    s.add(b)
    step = s.schedule()
    assert step.moves == [(a.kv_start, b.kv_start, 23)] and chunks(step) == [(b, 3)]
    assert b.num_cached == 23 and b.cached_tokens == 23
    s.update(step, StepSample.of(step, [5]))
    run(s)
    assert cache.entries() == [b]  # b holds all of a's tokens: a is gone
    assert cache.stats.hit_tokens == 23 and cache.stats.query_tokens == 20 + 26


def test_a_cache_salt_shares_prefixes_only_with_the_same_salt():
    """vLLM's cache_salt: the same conversation under another salt (or none) is a miss; under
    the same salt it is a hit of the same length an unsalted one gets."""
    s = make()
    a = seq("a", range(1, 21), cache_salt="tenant-1")
    s.add(a)
    run(s)
    cache = s.kv.prefix_cache
    for rid, salt, hit in (("b", "tenant-2", 0), ("c", "", 0), ("d", "tenant-1", 23)):
        b = seq(rid, [*a.token_ids, 50, 51], cache_salt=salt)
        s.add(b)
        step = s.schedule()
        assert b.cached_tokens == hit, rid
        s.update(step, StepSample.of(step, [5] * len(step.sampled)))
        run(s)
    assert cache.stats.hit_tokens == 23
    s.kv.allocator.check()


def test_a_hit_never_covers_the_last_prompt_token_and_identical_prompts_are_cached_once():
    s = make()
    a = seq("a", range(1, 11), max_tokens=1)
    s.add(a)
    run(s)
    b = seq("b", range(1, 11), max_tokens=1)
    s.add(b)
    step = s.schedule()
    assert step.moves == [(a.kv_start, b.kv_start, 9)] and chunks(step) == [(b, 1)]
    s.update(step, StepSample.of(step, [5]))
    assert s.kv.prefix_cache.entries() == [a]  # b's K/V (10 tokens) is a's: b was freed
    assert s.kv.allocator.reserved == 10


def test_prompt_logprobs_requests_do_not_use_the_cache():
    s = make()
    s.add(seq("a", range(1, 11)))
    run(s)
    b = seq("b", range(1, 11), prompt_logprobs=0)
    s.add(b)
    step = s.schedule()
    assert step.moves == [] and chunks(step) == [(b, 10)]


def test_cached_entries_count_as_free_and_are_evicted_lru_for_admission():
    s = make(capacity=70)
    x, y = seq("x", range(100, 120)), seq("y", range(200, 220))
    for r in (x, y, seq("x again", range(100, 120))):  # a hit: x is used more recently than y
        s.add(r)
        run(s)
    assert s.kv.prefix_cache.entries() == [y, x] and s.kv.allocator.reserved == 46
    s.add(seq("z", range(300, 330)))  # needs 34 slots: 24 are free, y holds 23 more
    step = s.schedule()
    assert s.kv.prefix_cache.entries() == [x] and s.kv.prefix_cache.stats.evictions == 1
    assert step.admitted[0].kv_start == y.kv_start and step.admitted[0].kv_reserved == 34


def test_a_growing_request_evicts_cached_entries_to_get_their_slots():
    s = make(capacity=40)
    a = seq("a", range(1, 11), max_tokens=30, predicted=2)  # will need the whole cache
    s.add(a)
    step = s.schedule()
    s.update(step, StepSample.of(step, [5]))
    b = seq("b", range(50, 60), max_tokens=1)  # finishes at once, cached right after a
    s.add(b)
    run(s)
    assert a.num_output == 30 and s.stats.preemptions == 0
    assert s.kv.prefix_cache.stats.evictions == 1


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_the_allocator_and_the_index_consistent(seed):
    """Conversations, shared system prompts and unrelated prompts, in a cache small enough to
    evict, compact and preempt: every hit copies the K/V of exactly the tokens it skips."""
    rng = random.Random(seed)
    s = make(capacity=300, budget=48)
    system = [rng.randrange(1000) for _ in range(30)]
    history: list[list[int]] = []
    owner: dict[int, tuple[str, int]] = {}  # slot -> (request, position) whose K/V it holds
    for i in range(60):
        kind = rng.random()
        if kind < 0.4 and history:
            prompt = rng.choice(history) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
        elif kind < 0.7:
            prompt = system + [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
        else:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        r = seq(f"r{i}", prompt, max_tokens=rng.randint(1, 30), predicted=rng.randint(1, 30))
        s.add(r)
        for _ in range(rng.randint(0, 4)):
            if not s.has_work():
                break
            step = s.schedule()
            _check_copies(step, owner)
            n = len(step.sampled)
            s.update(step, StepSample.of(step, [rng.randrange(1000) for _ in range(n)]))
            s.kv.allocator.check()
        if r.status is SeqStatus.FINISHED:
            history.append(r.token_ids)
    while s.has_work():
        step = s.schedule()
        _check_copies(step, owner)
        n = len(step.sampled)
        s.update(step, StepSample.of(step, [rng.randrange(1000) for _ in range(n)]))
    s.kv.allocator.check()
    for e in s.kv.prefix_cache.entries():
        assert s.kv.prefix_cache.index.tokens[e] == tuple(e.token_ids[: e.num_cached])


def _check_copies(step, owner: dict) -> None:
    """Track which token each slot's K/V is of (by value), through the step's moves and
    writes; a sequence's cached slots must hold its own tokens in order."""
    for a, b, n in step.moves:
        vals = [owner.get(a + i) for i in range(n)]
        for i, v in enumerate(vals):
            owner[b + i] = v
    for seq, n in [(d, 1) for d in decodes(step)] + chunks(step):
        first = seq.num_cached
        for p in range(first):
            assert owner.get(seq.kv_start + p) == seq.token_ids[p] or \
                seq.token_ids[p] == -1, (seq.request_id, p)
        for p in range(first, first + n):
            owner[seq.kv_start + p] = seq.token_ids[p]


def test_a_running_request_shares_its_prompt_once_prefilled():
    """A burst with a shared system prompt: the second request copies it from the first while
    the first still runs; preempting or finishing the first takes it out of the index."""
    s = make(budget=32)
    system = list(range(1, 41))
    a, b = seq("a", [*system, 41], max_tokens=20), seq("b", [*system, 42], max_tokens=20)
    s.add(a)
    s.add(b)
    first = s.schedule()  # a's first chunk (32 tokens): b waits for the budget
    s.update(first, StepSample.of(first, []))
    assert s.kv.prefix_cache.shared == set()
    second = s.schedule()  # a's last 9 tokens; b admitted, nothing to copy yet
    s.update(second, StepSample.of(second, [5]))
    assert not second.moves and s.kv.prefix_cache.shared == {a}
    assert s.kv.prefix_cache.entries() == []
    s.abort(b)
    c = seq("c", [*system, 43], max_tokens=20)
    s.add(c)
    step = s.schedule()
    assert (a.kv_start, c.kv_start, 40) in step.moves and (c, 1) in chunks(step)
    s.update(step, StepSample.of(step, [5, 5]))
    s.abort(a)
    assert s.kv.prefix_cache.shared == {c} and s.kv.prefix_cache.slots == 0


def test_split_free_space_is_joined_by_evicting_an_older_entry_beside_it_not_by_moves():
    from pipellm.services.compute.kv.prefix_cache import PrefixCache

    a = KVAllocator(100)
    cache = PrefixCache(a)
    e = []
    for i in range(4):  # entries at [0, 20), [20, 40), [40, 60), [60, 80); LRU order 0..3
        e.append(seq(f"e{i}", range(100 * i + 1, 100 * i + 21)))
        e[i].kv_start, e[i].num_cached = a.allocate(20), 20
        cache.keep(e[i])
    cache.evict(e[0])  # free: [0, 20) and [80, 100): 40 slots, split
    assert a.allocate(30) is None
    # the older half is e1, e2; only e1 borders free space, and it is spared; e3 (newest) is
    # beside [80, 100) but too recent
    assert not cache.evict_beside_free(spare=e[1])
    assert cache.evict_beside_free()
    assert cache.entries() == [e[2], e[3]] and a.allocate(30) == 0
