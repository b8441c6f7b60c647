"""n-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of a
request's last n tokens, n from prompt_lookup_max down to prompt_lookup_min.

Each request keeps an index {n-gram: end of its latest occurrence} per n, extended with the
tokens added since its last proposal (O(n_max) per new token), so a proposal costs a few dict
lookups whatever the context length.

Back-off: a verify that accepts fewer than half its drafts cost more rows than it saved steps,
so a request whose verifies keep doing that proposes nothing for its next 2, 4, ... 32 decode
steps (doubling with each such verify in a row, reset by a good one): on text that does not
copy from its context, speculation fades out instead of slowing every step.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from services.compute.core.sequence import UNSAMPLED, Sequence
from shared.speculative import SpeculativeConfig

MAX_SKIP = 32  # decode steps without proposals after poor verifies, at most


class _Index:
    """Per n in ns: {n-gram: the end (exclusive) of its latest occurrence that has a token
    after it}, over token_ids[:upto + 1]; and the request's back-off."""

    def __init__(self, ns: range):
        self.tables = {n: {} for n in ns}
        self.upto = 0  # n-grams ending at positions < upto are indexed
        self.skip = 0  # decode steps to propose nothing for
        self.poor = 0  # poor verifies in a row

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending before the last token (each has a token after it)."""
        for end in range(max(self.upto, 1), len(tokens)):
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(tokens[end - n:end])] = end
        self.upto = max(self.upto, len(tokens))


class NgramProposer:
    """Drafts for sequences about to decode (`propose`)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.ns = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self._indexes: WeakKeyDictionary[Sequence, _Index] = WeakKeyDictionary()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of seq's
        last n tokens (the longest n that occurs); [] when none does."""
        tokens = seq.token_ids
        if limit <= 0 or tokens[-1] == UNSAMPLED:
            return []
        index = self._indexes.get(seq)
        if index is None or index.upto > len(tokens):  # new, or its output was cut back
            index = self._indexes[seq] = _Index(self.ns)
        if index.skip:
            index.skip -= 1
            return []
        index.extend(tokens)
        for n in reversed(self.ns):
            end = index.tables[n].get(tuple(tokens[-n:])) if len(tokens) > n else None
            if end is not None:
                return tokens[end:end + min(self.k, limit)]
        return []

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """seq's verify of `drafted` drafts accepted `accepted`: back off after a poor one."""
        index = self._indexes.get(seq)
        if index is None:
            return
        if 2 * accepted >= drafted:
            index.poor = 0
            return
        index.poor += 1
        index.skip = min(2**index.poor, MAX_SKIP)
