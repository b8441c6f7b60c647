"""n-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of a
request's last n tokens, n from prompt_lookup_max down to prompt_lookup_min.

Each request keeps an index {n-gram: end of its latest occurrence} per n, extended with the
tokens added since its last proposal (O(n_max) per new token), so a proposal costs a few dict
lookups whatever the context length. A request backs off after poor verifies (backoff.py).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

from pipellm.services.compute.core.sequence import UNSAMPLED, Sequence
from pipellm.services.compute.speculative.backoff import Backoff
from pipellm.shared.speculative import SpeculativeConfig


class _Index:
    """Per n in ns: {n-gram: the end (exclusive) of its latest occurrence that has a token
    after it}, over token_ids[:upto + 1]."""

    def __init__(self, ns: range):
        self.tables = {n: {} for n in ns}
        self.upto = 0  # n-grams ending at positions < upto are indexed

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
        self.backoff = Backoff()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of seq's
        last n tokens (the longest n that occurs); [] when none does."""
        tokens = seq.token_ids
        if limit <= 0 or tokens[-1] == UNSAMPLED or self.backoff.skipping(seq):
            return []
        index = self._indexes.get(seq)
        if index is None or index.upto > len(tokens):  # new, or its output was cut back
            index = self._indexes[seq] = _Index(self.ns)
        index.extend(tokens)
        for n in reversed(self.ns):
            end = index.tables[n].get(tuple(tokens[-n:])) if len(tokens) > n else None
            if end is not None:
                return tokens[end:end + min(self.k, limit)]
        return []

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.backoff.verified(seq, drafted, accepted)
