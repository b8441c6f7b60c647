"""Workloads for benchmarks and the load generator: (prompt, prompt length, output length) items.

Real data comes from the ShareGPT samples in `default_data_dir()` (see its README); when a file
is missing, callers fall back to `synthetic()`, which needs no data at all.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

CHARS_PER_TOKEN = 4  # token-count estimate when no tokenizer is given
SHAREGPT_FILE = "sharegpt_samples_1024.json"
_SIGMA = 0.8  # spread of the synthetic lognormal lengths


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: its prompt text (None if synthetic) and token counts."""

    prompt: str | None
    prompt_len: int
    output_len: int


def default_data_dir() -> Path:
    """`<repo root>/../shared/data`, where every checkout finds the shared request data."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


def load_sharegpt(path: str | Path, tokenizer: Tokenizer | None = None,
                  limit: int | None = None) -> list[WorkItem]:
    """Items from a ShareGPT JSON file (a list of `{"conversations": [{"from", "value"}...]}`).

    The prompt is a conversation's first human turn and the output its first gpt answer after
    that; conversations without both (or with an empty prompt) are skipped. Lengths are counted
    with `tokenizer` (the prompt with special tokens, the answer without), else estimated as
    `CHARS_PER_TOKEN` characters per token; both are at least 1. At most `limit` items, in file
    order.
    """
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    items: list[WorkItem] = []
    for record in records:
        if limit is not None and len(items) >= limit:
            break
        pair = _first_exchange(record.get("conversations") or [])
        if pair is None:
            continue
        prompt, answer = pair
        items.append(WorkItem(prompt, max(_count(tokenizer, prompt, True), 1),
                              max(_count(tokenizer, answer, False), 1)))
    return items


def synthetic(n: int, seed: int = 0, mean_prompt: int = 256, mean_output: int = 256,
              ) -> list[WorkItem]:
    """`n` items with lognormal prompt and output lengths of the given means (each >= 1).

    Deterministic: the same arguments give the same items.
    """
    rng = random.Random(seed)

    def draw(mean: int) -> int:
        mu = math.log(max(mean, 1)) - _SIGMA**2 / 2  # so that the lognormal mean is `mean`
        return max(1, round(rng.lognormvariate(mu, _SIGMA)))

    return [WorkItem(None, draw(mean_prompt), draw(mean_output)) for _ in range(n)]


def _first_exchange(turns: list[dict]) -> tuple[str, str] | None:
    """(first human turn, first gpt turn after it), or None."""
    prompt = None
    for turn in turns:
        role, text = turn.get("from"), turn.get("value") or ""
        if prompt is None and role == "human" and text:
            prompt = text
        elif prompt is not None and role == "gpt":
            return prompt, text
    return None


def _count(tokenizer: Tokenizer | None, text: str, special: bool) -> int:
    if tokenizer is None:
        return round(len(text) / CHARS_PER_TOKEN)
    return len(tokenizer.encode(text, add_special_tokens=special).ids)
