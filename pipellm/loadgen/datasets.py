"""Workloads for benchmarks and the load generator: (prompt, prompt length, output length) items.

Real data comes from `default_data_dir()` (see its README): the ShareGPT samples (text, true
answer lengths) and the Azure 2023 conversation trace (arrival times and token counts, no text).
When a file is missing, callers fall back to `synthetic()` or `random_items()`, which need no
data at all. Items without a prompt (`prompt is None`) get one synthesized by
`pipellm.loadgen.prompts`.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from tokenizers import Tokenizer

CHARS_PER_TOKEN = 4  # token-count estimate when no tokenizer is given
SHAREGPT_FILE = "sharegpt_samples_1024.json"
AZURE_FILE = "azure_llm_trace_conv_2023.csv"
# vLLM's ShareGPT filter (benchmark_serving `is_valid_sequence`): drop tiny and long pairs
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
_SIGMA = 0.8  # spread of the synthetic lognormal lengths


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload: its prompt text (None if synthetic) and token counts."""

    prompt: str | None
    prompt_len: int
    output_len: int
    arrival_s: float | None = None  # trace replay: seconds after the trace's first request
    model: str = ""  # the model (a LoRA adapter) it names; "" for the endpoint's
    priority: int | None = None  # the body's `priority` (lower first); None: not sent
    request_class: str = ""  # its class in a priority mix ("interactive", "batch"); "": none


def default_data_dir() -> Path:
    """`<repo root>/data`, the request data the repository carries (see its README.md)."""
    return Path(__file__).resolve().parents[2] / "data"


def load_sharegpt(path: str | Path, tokenizer: Tokenizer | None = None,
                  limit: int | None = None) -> list[WorkItem]:
    """Items from a ShareGPT JSON file (a list of `{"conversations": [{"from", "value"}...]}`).

    The prompt is a conversation's first human turn and the output its first gpt answer after
    that; conversations without both (or with an empty prompt) are skipped. Lengths are counted
    with `tokenizer` (the prompt with special tokens, the answer without), else estimated as
    `CHARS_PER_TOKEN` characters per token; both are at least 1. At most `limit` items, in file
    order.
    """
    return [WorkItem(prompt, max(_count(tokenizer, prompt, True), 1),
                     max(_count(tokenizer, answer, False), 1))
            for prompt, answer in sharegpt_pairs(path, limit)]


def sharegpt_pairs(path: str | Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(first human turn, first gpt answer after it) of each ShareGPT conversation that has
    both (and a non-empty prompt), in file order, at most `limit`."""
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    pairs: list[tuple[str, str]] = []
    for record in records:
        if limit is not None and len(pairs) >= limit:
            break
        pair = _first_exchange(record.get("conversations") or [])
        if pair is not None:
            pairs.append(pair)
    return pairs


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


def sample_sharegpt(path: str | Path, n: int, seed: int = 0,
                    tokenizer: Tokenizer | None = None) -> list[WorkItem]:
    """`n` items of a ShareGPT file as `vllm bench serve` picks them: pairs with both lengths
    >= 4, prompt <= 1024 and prompt + output <= 2048 tokens, in an order shuffled by `seed`.

    When the file has fewer valid pairs than `n`, the shuffled list repeats (vLLM oversamples
    the same way). Raises ValueError if it has none.
    """
    valid = [w for w in load_sharegpt(path, tokenizer)
             if w.prompt_len >= SHAREGPT_MIN_LEN and w.output_len >= SHAREGPT_MIN_LEN
             and w.prompt_len <= SHAREGPT_MAX_PROMPT
             and w.prompt_len + w.output_len <= SHAREGPT_MAX_TOTAL]
    if not valid:
        raise ValueError(f"{path}: no usable prompt/answer pairs")
    random.Random(seed).shuffle(valid)
    return [valid[i % len(valid)] for i in range(n)]


def load_azure_trace(path: str | Path, limit: int | None = None) -> list[WorkItem]:
    """Items of an Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).

    `arrival_s` is each row's time after the first row's (rows in file order; the first `limit`
    rows). TIMESTAMP is "YYYY-MM-DD HH:MM:SS[.fraction]" (any number of fraction digits) or a
    number of seconds. Prompts are None (the trace has no text); lengths are at least 1.
    """
    items: list[WorkItem] = []
    t0 = None
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if limit is not None and len(items) >= limit:
                break
            t = _seconds(row["TIMESTAMP"])
            t0 = t if t0 is None else t0
            items.append(WorkItem(None, max(int(row["ContextTokens"]), 1),
                                  max(int(row["GeneratedTokens"]), 1), t - t0))
    return items


def random_items(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                 seed: int = 0) -> list[WorkItem]:
    """`n` items with lengths uniform in [floor(L * (1 - r)), ceil(L * (1 + r))] (vLLM's random
    dataset; r = `range_ratio` in [0, 1), 0 = every item exactly L); each length >= 1.
    Deterministic for a seed."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1)")
    rng = random.Random(seed)

    def draw(length: int) -> int:
        low = math.floor(length * (1 - range_ratio))
        high = math.ceil(length * (1 + range_ratio))
        return max(1, rng.randint(low, high))

    return [WorkItem(None, draw(input_len), draw(output_len)) for _ in range(n)]


def clip_to_context(items: list[WorkItem], max_model_len: int) -> list[WorkItem]:
    """Items that fit a `max_model_len` context: an item with prompt + output > max_model_len
    gets its prompt cut to at most half the context, then its output to the rest. Items that fit
    are unchanged (same objects); clipped ones lose their prompt text so it is synthesized anew.
    """
    out = []
    for w in items:
        if w.prompt_len + w.output_len <= max_model_len:
            out.append(w)
            continue
        prompt_len = min(w.prompt_len, max_model_len // 2)
        prompt = w.prompt if prompt_len == w.prompt_len else None
        out.append(replace(w, prompt=prompt, prompt_len=prompt_len,
                           output_len=max(1, min(w.output_len, max_model_len - prompt_len))))
    return out


def _seconds(stamp: str) -> float:
    """A trace TIMESTAMP as seconds (epoch for dates; as is for plain numbers)."""
    stamp = stamp.strip()
    try:
        return float(stamp)
    except ValueError:
        pass
    whole, _, frac = stamp.partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    return base.timestamp() + (float("0." + frac) if frac else 0.0)
