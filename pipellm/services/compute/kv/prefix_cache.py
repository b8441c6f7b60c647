"""Prefix caching on contiguous segments (pure logic: no KV, no device).

Entries are finished `Sequence`s shrunk to the tokens whose K/V they hold, indexed by those tokens
(`PrefixIndex`; behind keys of its cache_salt and its LoRA adapter where it has them), counted as
free and evicted least recently used first. Running requests are indexed by prompt once
prefilled (`share`), never evicted here. A hit is copied into the new request's own segment as
a step move. Invariant: the slots [kv_start, kv_start + len(tokens)) of every indexed sequence
hold the K/V of index.tokens[it] (after the salt's and adapter's keys) once the steps in flight
have run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.kv.allocator import KVAllocator
from pipellm.services.compute.kv.prefix_index import PrefixIndex


@dataclass
class PrefixStats:
    queries: int = 0  # admissions that looked the prompt up
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of them, served from the cache
    evictions: int = 0


class PrefixCache:
    def __init__(self, allocator: KVAllocator):
        self.allocator = allocator
        self.index = PrefixIndex()
        self.stats = PrefixStats()
        self.slots = 0  # slots held by entries (sum of their kv_reserved)
        self.shared: set[Sequence] = set()  # running requests in the index (not entries)

    def entries(self) -> list[Sequence]:
        """The cached segments, least recently used first."""
        return [e for e in self.index.tokens if e not in self.shared]

    def share(self, seq: Sequence) -> None:
        """Index the running seq by its prompt, whose K/V its segment now holds (or will, once
        the step in flight has run)."""
        if seq not in self.shared:
            self.shared.add(seq)
            self.index.insert(seq, _key(seq, seq.token_ids[: seq.num_prompt]))

    def unshare(self, seq: Sequence) -> None:
        """seq stops running: out of the index (its segment is freed or kept as an entry)."""
        if seq in self.shared:
            self.shared.discard(seq)
            self.index.remove(seq)

    def keep(self, seq: Sequence) -> None:
        """Cache the finished seq's segment (it is no longer running): shrunk to its K/V, and
        replacing the entries it contains (a conversation's earlier turns)."""
        n = min(seq.num_cached, seq.num_tokens)
        tokens = _key(seq, seq.token_ids[:n])
        entry, common = self.index.match(tokens) if n else (None, 0)
        if n == 0 or common == len(tokens):  # nothing new: an entry already holds all of it
            self.allocator.free(seq.kv_start)
            return
        while entry is not None and entry not in self.shared and \
                common == len(self.index.tokens[entry]):
            self.evict(entry)  # holds a prefix of seq's tokens: seq holds it all
            entry, common = self.index.match(tokens)
        self.allocator.resize(seq.kv_start, n)  # shrinks in place
        seq.kv_reserved = seq.num_cached = n
        self.index.insert(seq, tokens)
        self.slots += n

    def lookup(self, seq: Sequence) -> tuple[Sequence | None, int]:
        """(the entry holding the longest prefix of seq's tokens, that length), at most all but
        seq's last token (the step must compute its logits); (None, 0) on a miss."""
        entry, n = self.index.match(_key(seq, seq.token_ids[: seq.num_tokens - 1]))
        n -= len(_scope(seq))  # the salt's and the adapter's keys matched too
        return (entry, n) if n > 0 else (None, 0)

    def admitted(self, seq: Sequence, entry: Sequence | None, n: int) -> None:
        """Count seq's lookup, admitted with n tokens copied from `entry` (which is now the most
        recently used)."""
        self.stats.queries += 1
        self.stats.query_tokens += seq.num_tokens
        if entry is not None:
            self.index.touch(entry)
            self.stats.hit_tokens += n

    def evict(self, entry: Sequence) -> None:
        self.index.remove(entry)
        self.allocator.free(entry.kv_start)
        self.slots -= entry.kv_reserved
        self.stats.evictions += 1

    def evict_lru(self, spare: Sequence | None = None) -> bool:
        """Evict the least recently used entry other than `spare`; False if there is none."""
        for entry in self.index.tokens:
            if entry is not spare and entry not in self.shared:
                self.evict(entry)
                return True
        return False

    def evict_beside_free(self, spare: Sequence | None = None) -> bool:
        """Evict the entry, among the older half (least recently used first, never `spare`),
        whose slots with the free blocks on both sides make the largest free block: space made
        contiguous without copying anything. False if no such entry borders free space."""
        free = dict(self.allocator.free_blocks())  # start -> size
        ends = {s + n: n for s, n in free.items()}
        older = self.entries()
        best, most = None, 0
        for e in older[: (len(older) + 1) // 2]:
            around = ends.get(e.kv_start, 0) + free.get(e.kv_start + e.kv_reserved, 0)
            if around and e is not spare and around + e.kv_reserved > most:
                best, most = e, around + e.kv_reserved
        if best is not None:
            self.evict(best)
        return best is not None

    def entry_at(self, start: int) -> Sequence | None:
        """The entry whose segment starts at `start`, if any."""
        return next((e for e in self.entries() if e.kv_start == start), None)


def _key(seq: Sequence, tokens: list[int]) -> list[int]:
    """What the index keys seq's tokens by: `_scope`'s ids first, so only requests with the
    same cache_salt and the same LoRA adapter share a prefix."""
    return [*_scope(seq), *tokens]


def _scope(seq: Sequence) -> list[int]:
    """Negative ids (token ids are >= 0) derived from seq's cache_salt and its LoRA adapter,
    those it has: K/V computed under other weights or for another tenant never match."""
    scope = []
    for key in (seq.params.cache_salt, seq.params.lora_name and f"\0lora:{seq.params.lora_name}"):
        if key:
            digest = hashlib.blake2b(key.encode(), digest_size=7).digest()
            scope.append(-1 - int.from_bytes(digest, "little"))
    return scope
