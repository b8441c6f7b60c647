"""Prompts of a given token length for workloads that have only lengths (Azure trace, random).

A client does not know the server's tokenizer, so prompts are random sequences of common
English words, always starting with the anchor word "the", and their lengths come from the
server itself. `calibrate` sends the anchor alone and the anchor followed by each word of
`WORDS` (17 requests with `max_tokens` 1) and reads `usage.prompt_tokens`:
`anchor_tokens` is the first count (it includes BOS and, on /v1/chat/completions, the chat
template) and each word's cost is the difference. A prompt's length is then predicted as
anchor_tokens + the sum of its words' costs, and `fill_prompts` picks words until that sum hits
the target exactly.

The approximation: the prediction is exact when the tokenizer splits on whitespace before
merging (Llama 2/3, Mistral, Qwen2 and GPT BPE tokenizers do: no token spans two words) and the
chat template adds the same tokens whatever the content. Otherwise a prompt may be off by a token
or so per word boundary. Targets shorter than the anchor give the anchor alone. The metrics never
use targets: prompt lengths are the server's own `usage.prompt_tokens`. Prompts are distinct
random word sequences (deterministic for a seed), so a prefix cache cannot serve them from an
earlier request.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from pipellm.loadgen.datasets import WorkItem

ANCHOR = "the"
WORDS = tuple("""
time year people way day man thing woman life child world school state family student group
""".split())
CONCURRENCY = 16


@dataclass(frozen=True)
class PromptModel:
    """Server-counted prompt tokens: `anchor_tokens` for the anchor, plus each word's cost."""

    anchor_tokens: int = 1
    costs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WORDS, 1))

    def length(self, text: str) -> int:
        """Predicted prompt tokens of a synthesized prompt (anchor + words)."""
        return self.anchor_tokens + sum(self.costs[w] for w in text.split()[1:])

    def text(self, tokens: int, rng: random.Random) -> str:
        """A prompt of `tokens` tokens: the anchor, then random words until the costs add up
        (exactly, when a word of cost 1 exists; else within the smallest cost)."""
        by_cost = sorted(self.costs.items())
        longest = max(self.costs.values())
        out, left = [ANCHOR], tokens - self.anchor_tokens
        while left > 0:
            choices = by_cost if left >= longest else [w for w in by_cost if w[1] <= left]
            if not choices:
                break
            word, cost = rng.choice(choices)
            out.append(word)
            left -= cost
        return " ".join(out)


def fill_prompts(items: list[WorkItem], model: PromptModel, seed: int = 0) -> list[WorkItem]:
    """Items with a prompt everywhere: those without one get a synthesized prompt of their
    `prompt_len` tokens. Deterministic for a seed; items with text are kept as they are."""
    rng = random.Random(seed)
    return [w if w.prompt is not None else replace(w, prompt=model.text(w.prompt_len, rng))
            for w in items]


async def calibrate(count_tokens: Callable[[str], Awaitable[int | None]],
                    ) -> PromptModel | None:
    """The server's `PromptModel`: `count_tokens(prompt)` returns the prompt tokens the server
    counted (None when it did not say). None if the server does not say; words whose cost is
    not positive (the tokenizer merged across the boundary) are left out."""
    sem = asyncio.Semaphore(CONCURRENCY)

    async def count(text: str) -> int | None:
        async with sem:
            return await count_tokens(text)

    anchor = await count(ANCHOR)
    if anchor is None:
        return None
    counts = await asyncio.gather(*(count(f"{ANCHOR} {w}") for w in WORDS))
    costs = {w: n - anchor for w, n in zip(WORDS, counts, strict=True)
             if n is not None and n > anchor}
    return PromptModel(anchor, costs) if costs else None


def local_model(encode: Callable[[str], int]) -> PromptModel:
    """A `PromptModel` from a local tokenizer (`encode(text)` -> token count)."""
    anchor = encode(ANCHOR)
    costs = {w: encode(f"{ANCHOR} {w}") - anchor for w in WORDS}
    return PromptModel(anchor, {w: c for w, c in costs.items() if c > 0})
