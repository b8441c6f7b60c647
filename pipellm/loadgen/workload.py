"""From command-line choices to (items with prompts, arrival offsets).

Modes: `poisson` (gamma arrivals at --request-rate; inf = all at once), `trace` (the Azure
trace's own arrival times, times --trace-time-scale), `burst` (every request at once), and
`throughput` (the talk's theoretical maximum: every request at once with the same prompt and
the same lengths, with ignore_eos). The default is `trace` for the Azure dataset, else `poisson`.

A priority mix (`--interactive-fraction F`): a seeded F of the requests become "interactive"
(`--interactive-input-len` / `--interactive-output-len` tokens, the body's `priority`
`--interactive-priority`), the rest "batch" (the dataset's requests, `priority`
`--batch-priority`); the result then holds each class's TTFT and E2EL (`classes`).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

from tokenizers import Tokenizer

from pipellm.loadgen import arrivals
from pipellm.loadgen.client import Endpoint
from pipellm.loadgen.datasets import (
    AZURE_FILE,
    SHAREGPT_FILE,
    WorkItem,
    clip_to_context,
    default_data_dir,
    load_azure_trace,
    random_items,
    sample_sharegpt,
)
from pipellm.loadgen.prefix_datasets import PREFIX_DATASETS, multiturn_items, shared_prefix_items
from pipellm.loadgen.prompts import PromptModel, fill_prompts, local_model
from pipellm.loadgen.runner import prompt_model

MODES = ("poisson", "trace", "burst", "throughput")
DATASETS = ("random", "sharegpt", "azure", *PREFIX_DATASETS)


def mode_of(args: argparse.Namespace) -> str:
    return args.mode or ("trace" if args.dataset_name == "azure" else "poisson")


def load_tokenizer(path: str | None) -> Tokenizer | None:
    """A `tokenizers` tokenizer from a tokenizer.json file or a directory holding one."""
    if not path:
        return None
    p = Path(path)
    return Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))


def load_items(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[WorkItem]:
    """`--num-prompts` items of the chosen dataset (lengths only where it has no text)."""
    n, name = args.num_prompts, args.dataset_name
    if name == "random":
        if args.dataset_path:
            raise ValueError("the random dataset takes no --dataset-path")
        return random_items(n, args.random_input_len, args.random_output_len,
                            args.random_range_ratio, args.seed)
    default = AZURE_FILE if name == "azure" else SHAREGPT_FILE
    path = Path(args.dataset_path or default_data_dir() / default)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: give --dataset-path")
    if name == "sharegpt":
        return sample_sharegpt(path, n, args.seed, tokenizer)
    if name == "sharegpt-multiturn":
        return multiturn_items(path, n, args.seed, tokenizer)
    if name == "shared-prefix":
        return shared_prefix_items(path, n, args.seed, tokenizer)
    items = load_azure_trace(path, limit=n)
    if len(items) < n:
        print(f"warning: the trace has only {len(items)} requests", file=sys.stderr)
    return items


def offsets(args: argparse.Namespace, items: list[WorkItem]) -> list[float]:
    """The arrival offsets of the mode."""
    mode = mode_of(args)
    if mode == "poisson":
        return arrivals.poisson(len(items), args.request_rate, args.burstiness, args.seed)
    if mode == "trace":
        if any(w.arrival_s is None for w in items):
            raise ValueError("--mode trace needs a dataset with arrival times (azure)")
        return arrivals.trace([w.arrival_s for w in items], args.trace_time_scale)
    return arrivals.burst(len(items))


def build(args: argparse.Namespace, ep: Endpoint, max_model_len: int | None,
          ) -> tuple[list[WorkItem], list[float]]:
    """Items (clipped to the context, every one with a prompt) and their arrival offsets."""
    tokenizer = load_tokenizer(args.tokenizer)
    items = load_items(args, tokenizer)
    if mode_of(args) == "throughput":
        items = [items[0]] * len(items)
    if getattr(args, "interactive_fraction", 0.0):
        items = priority_mix(items, args.interactive_fraction, args.interactive_input_len,
                             args.interactive_output_len, args.interactive_priority,
                             args.batch_priority, args.seed)
    limit = args.max_model_len or max_model_len
    if limit:
        clipped = clip_to_context(items, limit)
        if changed := sum(a is not b for a, b in zip(items, clipped, strict=True)):
            print(f"note: {changed} requests clipped to the {limit}-token context",
                  file=sys.stderr)
        items = clipped
    if any(w.prompt is None for w in items):
        pm = fitted_prompt_model(ep, tokenizer)
        items = fill_prompts(items, pm, args.seed)
        if mode_of(args) == "throughput":
            items = [items[0]] * len(items)
    if args.lora_modules:  # as vllm bench serve: each request names one, at random
        rng = random.Random(args.seed)
        items = [replace(w, model=rng.choice(args.lora_modules)) for w in items]
    return items, offsets(args, items)


def priority_mix(items: list[WorkItem], fraction: float, input_len: int, output_len: int,
                 interactive_priority: int = 0, batch_priority: int = 1, seed: int = 0,
                 ) -> list[WorkItem]:
    """`round(fraction * len(items))` items, picked by `seed`, replaced by interactive ones
    (synthesized prompts of `input_len` tokens, `output_len` out, `interactive_priority`); the
    others kept as batch requests at `batch_priority`. Order and arrival times stay."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("--interactive-fraction must be in [0, 1]")
    if input_len < 1 or output_len < 1:
        raise ValueError("interactive lengths must be >= 1")
    picked = set(random.Random(seed ^ 0x51).sample(range(len(items)),
                                                   round(fraction * len(items))))
    return [replace(w, prompt=None, prompt_len=input_len, output_len=output_len,
                    priority=interactive_priority, request_class="interactive")
            if i in picked else replace(w, priority=batch_priority, request_class="batch")
            for i, w in enumerate(items)]


def fitted_prompt_model(ep: Endpoint, tokenizer: Tokenizer | None) -> PromptModel:
    """The server's prompt model; else one from --tokenizer; else 1 token per word."""
    pm = prompt_model(ep)
    if pm is None and tokenizer is not None:
        pm = local_model(lambda text: len(tokenizer.encode(text).ids))
    if pm is None:
        print("warning: the server reported no usage.prompt_tokens and no --tokenizer was "
              "given: assuming 1 token per word", file=sys.stderr)
        pm = PromptModel()
    return pm
