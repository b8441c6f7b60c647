"""The prefix index (radix tree over token ids, LRU order) against brute force."""

from __future__ import annotations

import random

import pytest

from pipellm.services.compute.kv.prefix_index import PrefixIndex


def brute(entries: dict[int, tuple[int, ...]], tokens: list[int]) -> int:
    best = 0
    for seq in entries.values():
        k = 0
        while k < min(len(seq), len(tokens)) and seq[k] == tokens[k]:
            k += 1
        best = max(best, k)
    return best


def test_random_inserts_matches_and_removals_agree_with_brute_force():
    rng = random.Random(0)
    index, live = PrefixIndex(), {}
    stems = [[rng.randrange(6) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    for step in range(600):
        op = rng.random()
        if op < 0.4 or not live:
            e = step
            seq = tuple(rng.choice(stems)[: rng.randint(1, 12)] + [rng.randrange(6) for _ in
                                                                   range(rng.randint(0, 6))])
            index.insert(e, seq)
            live[e] = seq
        elif op < 0.6:
            e = rng.choice(list(live))
            index.remove(e)
            del live[e]
        q = rng.choice(stems) + [rng.randrange(6) for _ in range(rng.randint(0, 5))]
        entry, n = index.match(q)
        assert n == brute(live, q)
        if n:  # the entry named really holds that prefix
            assert live[entry][:n] == tuple(q[:n])
        else:
            assert entry is None
    assert len(index) == len(live)


def test_most_recent_entry_wins_and_lru_order():
    index = PrefixIndex()
    index.insert("a", [1, 2, 3, 4])
    index.insert("b", [1, 2, 3, 9])
    assert index.match([1, 2, 3]) == ("b", 3)  # both hold it: the newer
    index.touch("a")
    assert index.match([1, 2, 3, 7]) == ("a", 3)
    assert index.match([1, 2, 3, 4, 5]) == ("a", 4)
    assert index.lru() == "b"
    index.remove("b")
    assert index.lru() == "a" and index.match([1, 2, 3, 9]) == ("a", 3)
    index.remove("a")
    assert index.match([1]) == (None, 0) and index.lru() is None and not index.root.children
    with pytest.raises(ValueError):
        index.insert("c", [])
    index.insert("c", [5])
    with pytest.raises(ValueError):
        index.insert("c", [6])
