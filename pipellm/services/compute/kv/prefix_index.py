"""Which cached KV holds the longest prefix of a prompt: a radix tree over token ids, with the
cached entries in least-recently-used order. Pure logic (no KV, no device).

An entry is a token sequence whose K/V sit, in order, in one contiguous segment (a finished
request's prompt + output, kept for prefix caching, issue "prefix caching"). Each tree node
lists the entries that pass through it, so the deepest node a prompt reaches names entries
holding that whole prefix. Invariants: an edge's label is non-empty; sibling edges start with
different tokens; a node's `entries` are exactly the entries whose tokens spell the path to it
(and beyond); nodes with no entry are pruned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    label: tuple[int, ...] = ()  # the edge's tokens, from the parent to this node
    children: dict[int, _Node] = field(default_factory=dict)  # by the child label's first token
    entries: set[Hashable] = field(default_factory=set)


class PrefixIndex:
    def __init__(self):
        self.root = _Node()
        self.tokens: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()  # LRU first
        self.stamp: dict[Hashable, int] = {}  # larger: used more recently
        self._clock = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def insert(self, entry: Hashable, tokens: Sequence[int]) -> None:
        """Index `entry`, holding the K/V of `tokens` (non-empty); it becomes the most recent."""
        if entry in self.tokens:
            raise ValueError(f"entry {entry!r} is already indexed")
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("an entry holds at least one token")
        self.tokens[entry] = tokens
        self.touch(entry)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = child = _Node(tokens[i:])
            k = _common(child.label, tokens, i)
            if k < len(child.label):
                child = self._split(node, child, k)
            child.entries.add(entry)
            node, i = child, i + k

    def match(self, tokens: Sequence[int]) -> tuple[Hashable | None, int]:
        """(an entry holding the longest cached prefix of `tokens`, its length); the most
        recently used such entry; (None, 0) if none starts like `tokens`. Does not touch."""
        node, i, best = self.root, 0, None
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common(child.label, tokens, i)
            best, i = child, i + k
            if k < len(child.label):
                break
            node = child
        if best is None:
            return None, 0
        return max(best.entries, key=self.stamp.__getitem__), i

    def touch(self, entry: Hashable) -> None:
        """Mark `entry` used now (a hit copied from it)."""
        self.tokens.move_to_end(entry)
        self._clock += 1
        self.stamp[entry] = self._clock

    def lru(self) -> Hashable | None:
        """The least recently used entry (the next to evict), or None."""
        return next(iter(self.tokens), None)

    def remove(self, entry: Hashable) -> None:
        """Forget `entry` (evicted, or its segment reused); prunes nodes no entry passes."""
        tokens = self.tokens.pop(entry)
        del self.stamp[entry]
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children[tokens[i]]
            child.entries.discard(entry)
            if not child.entries:
                del node.children[tokens[i]]
                return
            node, i = child, i + len(child.label)

    @staticmethod
    def _split(parent: _Node, child: _Node, k: int) -> _Node:
        """Cut child's edge after k tokens: a new node in between, returned."""
        mid = _Node(child.label[:k], {child.label[k]: child}, set(child.entries))
        child.label = child.label[k:]
        parent.children[mid.label[0]] = mid
        return mid


def _common(label: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many of label's tokens equal tokens[start:]'s."""
    n = min(len(label), len(tokens) - start)
    k = 0
    while k < n and label[k] == tokens[start + k]:
        k += 1
    return k
