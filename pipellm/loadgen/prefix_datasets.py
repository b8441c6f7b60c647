"""Prefix-heavy workloads built from the ShareGPT samples (each holds one exchange):

- `sharegpt-multiturn`: conversations of `turns` turns; turn k's prompt is turn k-1's prompt,
  its answer (the sample's real answer) and a new question (the next sample's), as a chat
  transcript. Items come turn by turn across the conversations (every conversation's first
  turn, then every second turn...), so with a finite request rate a turn arrives after the one
  before it has usually finished, and a prefix cache holds all of its prompt but the new part.
- `shared-prefix`: every prompt opens with the same system text of `system_tokens` tokens
  (ShareGPT answers, concatenated), then one ShareGPT question.

Questions and answers are cut to `part_tokens` tokens so conversations fit small contexts;
output lengths are the (cut) answers' lengths. Deterministic for a seed.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

from pipellm.loadgen.datasets import CHARS_PER_TOKEN, WorkItem, sharegpt_pairs

PREFIX_DATASETS = ("sharegpt-multiturn", "shared-prefix")


def _counter(tokenizer: Tokenizer | None):
    if tokenizer is None:
        return lambda text: max(round(len(text) / CHARS_PER_TOKEN), 1)
    return lambda text: max(len(tokenizer.encode(text, add_special_tokens=False).ids), 1)


def _cut(text: str, tokens: int, count) -> str:
    """`text` cut (at a word boundary) to at most about `tokens` tokens."""
    words = text.split()
    lo, hi = 0, len(words)
    while lo < hi:  # the most words that fit
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[: max(lo, 1)])


def _pairs(path: str | Path, seed: int, count, part_tokens: int) -> list[tuple[str, str]]:
    pairs = [(q, a) for q, a in sharegpt_pairs(path) if q.strip() and a.strip()]
    random.Random(seed).shuffle(pairs)
    return [(_cut(q, part_tokens, count), _cut(a, part_tokens, count)) for q, a in pairs]


def multiturn_items(path: str | Path, n: int, seed: int = 0, tokenizer: Tokenizer | None = None,
                    turns: int = 4, part_tokens: int = 160) -> list[WorkItem]:
    """`n` turns of ceil(n / turns) conversations, turn by turn across them."""
    count = _counter(tokenizer)
    pairs = _pairs(path, seed, count, part_tokens)
    chats = -(-n // turns)
    items: list[list[WorkItem]] = [[] for _ in range(turns)]
    for c in range(chats):
        transcript = ""
        for k in range(turns):
            q, a = pairs[(c * turns + k) % len(pairs)]
            transcript += f"User: {q}\nAssistant:"
            items[k].append(WorkItem(transcript, count(transcript), count(a)))
            transcript += f" {a}\n"
    return [w for turn in items for w in turn][:n]


def shared_prefix_items(path: str | Path, n: int, seed: int = 0,
                        tokenizer: Tokenizer | None = None, system_tokens: int = 1024,
                        part_tokens: int = 160) -> list[WorkItem]:
    """`n` questions behind one shared system text of about `system_tokens` tokens."""
    count = _counter(tokenizer)
    answers = [a for _, a in sharegpt_pairs(path)]
    system = _cut(" ".join(answers), system_tokens, count)
    pairs = _pairs(path, seed, count, part_tokens)
    out = []
    for i in range(n):
        q, a = pairs[i % len(pairs)]
        prompt = f"{system}\n\nUser: {q}\nAssistant:"
        out.append(WorkItem(prompt, count(prompt), count(a)))
    return out
