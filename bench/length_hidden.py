"""Hidden-state length prediction on real lengths: the rows bench/length_predictor.py adds.

Length sets (both in SmolLM2 tokens, the first 1024 ShareGPT samples, their first question in
the chat template): SmolLM2-135M-Instruct's own outputs (bench/data/smollm2_lengths.jsonl, made
by bench/length_data.py, greedy and t=0.7, with the final-normed hidden states it recorded
while generating: the last prompt token, then every 32 generated tokens) and the samples'
ChatGPT answers (the prompt's hidden state only, computed here once and cached).

Online, in arrival order (or shuffled): each request is predicted, then learned, by the
engine's own refiner (pipellm/services/compute/length/refiner.py) on in-memory stores.
- `hidden`: the prediction after prefill; reserve its quantile, point = its median.
- `refined`: the newest prediction at each checkpoint: the reservation grows (never shrinks)
  to generated + the remaining length's quantile; outgrown if the true length passes the last
  reservation; point error = the mean over the request's checkpoints of |median - true|.
- `global_refined`, its baseline: the same checkpoints with the global distribution conditioned
  on the tokens generated (as the scheduler regrows segments under the text prior).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import length_data
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, sharegpt_pairs
from pipellm.services.compute.core.sequence import Sequence
from pipellm.services.compute.length.head import probe_dim, probe_matrix
from pipellm.services.compute.length.refiner import LengthRefiner, RefinerConfig
from pipellm.services.compute.length.store import memory_stores
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import encode, load_tokenizer

MIN_REQUESTS = 16


@dataclass
class Item:
    prompt: int  # tokens
    max_tokens: int
    true: int  # output tokens
    hidden: np.ndarray  # [checkpoints, hidden] float32: at generated = 0, every, 2 every, ...
    index: int  # the sample's


def prompt_hidden(runner, prompt: list[int]) -> np.ndarray:
    """[1, hidden] the final-normed hidden state of the last prompt token (one prefill)."""
    from pipellm.services.compute.kv.sizing import profile_batch

    batch = profile_batch(len(prompt), 1, runner.device)
    batch.input_ids.copy_(torch.tensor(prompt))
    with torch.inference_mode():
        _, hidden = runner.model.forward_hidden(batch, runner.kv)
    return hidden.float().cpu().numpy()


def smollm2_items(setting: str, limit: int | None, cache: Path = length_data.CACHE,
                  ) -> list[Item]:
    """SmolLM2's own outputs (bench/length_data.py's complete chunks) with the hidden states
    recorded while generating them."""
    items = []
    for chunk in length_data.read_chunks(setting, cache):
        off = chunk["offsets"]
        items += [Item(r["prompt_tokens"], length_data.MAX_TOKENS, r["output_tokens"],
                       chunk["hidden"][off[i] : off[i + 1]].astype(np.float32), r["index"])
                  for i, r in enumerate(chunk["rows"])]
    return items[:limit]


def chatgpt_items(indices: list[int], cache: Path = length_data.CACHE) -> list[Item]:
    """The same samples' ChatGPT answers (SmolLM2 tokens, capped at max_tokens), with the
    prompt's hidden state only: no refinement (that would need the answers teacher-forced)."""
    from pipellm.services.compute.backend import build_engine
    from pipellm.shared import default_model
    from pipellm.shared.config import EngineConfig

    path = cache / "chatgpt_prompt_hidden.npz"
    model = default_model.resolve()
    prompts = length_data.chat_prompts(model, max(indices) + 1)
    answers = chatgpt_answers(model, len(prompts))
    have = np.load(path)["hidden"] if path.is_file() else np.zeros((0, 1), np.float16)
    if len(have) < len(prompts):
        runner = build_engine(EngineConfig(model=model, kv_cache_tokens=16384,
                                           hidden_length=False)).runner
        new = [prompt_hidden(runner, p)[0] for p in prompts[len(have):]]
        have = np.concatenate([have, np.stack(new).astype(np.float16)]) if len(have) else \
            np.stack(new).astype(np.float16)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, hidden=have)
    return [Item(len(prompts[i]), length_data.MAX_TOKENS, len(answers[i]),
                 have[i : i + 1].astype(np.float32), i) for i in indices]


def chatgpt_answers(model: str, n: int) -> list[list[int]]:
    """The samples' ChatGPT answers in the model's tokens, capped at MAX_TOKENS."""
    tok = load_tokenizer(model)
    pairs = sharegpt_pairs(default_data_dir() / SHAREGPT_FILE, n)
    return [encode(tok, a, add_special_tokens=False)[: length_data.MAX_TOKENS] or [0]
            for _, a in pairs]


def run_online(items: list[Item], dim: int, every: int, l2: tuple[float, float],
               seed: int | None = None) -> dict:
    """Predict-then-learn through the engine's own LengthRefiner (memory stores, solving after
    every request; `dim` as --length-probe-dim, `l2` per stage): per request, the prediction in
    force at each checkpoint (None until the head after prefill has learned MIN_REQUESTS
    requests)."""
    order = list(range(len(items)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    hidden = items[0].hidden.shape[1]
    probe = probe_matrix(hidden, probe_dim(hidden, dim))
    refiner = LengthRefiner(memory_stores(), RefinerConfig(
        min_requests=MIN_REQUESTS, l2=l2, push_s=0, refresh_s=0, background=False))
    out = []
    for i in order:
        it = items[i]
        proj = it.hidden @ probe
        seq = Sequence(str(i), [0] * it.prompt, SamplingParams(max_tokens=it.max_tokens),
                       seed=0, max_len=it.prompt + it.max_tokens, predicted_length=None,
                       stop_ids=frozenset())
        dists = []
        for k, p in enumerate(proj):  # a stage without a head yet keeps the last prediction
            refiner.observe([(seq, k * every, p)])
            dists.append(seq.predicted_length)
        out.append((i, dists if dists[0] is not None else None))
        seq.token_ids += [0] * it.true
        seq.finish_reason = "length" if it.true >= it.max_tokens else "stop"
        refiner.finished(seq)
        refiner.tick()
    return {"order": order, "predictions": out}


def conditioned(item: Item, dist: LengthDist, q: float, every: int) -> tuple[int, float]:
    """(reserved, mean point error) of `dist` conditioned on the output so far at each of the
    item's checkpoints: `refined`'s protocol without the hidden states."""
    res = max(min(dist.conditional_quantile(k * every, q), item.max_tokens)
              for k in range(len(item.hidden)))
    errs = [abs(dist.conditional_quantile(k * every, 0.5) - item.true)
            for k in range(len(item.hidden))]
    return res, float(np.mean(errs))


def reservations(item: Item, dists: list[LengthDist] | None, fallback: LengthDist, q: float,
                 every: int) -> tuple[int, int, float, float]:
    """(hidden reserved, refined reserved, hidden point error, refined mean point error)."""
    if dists is None:
        dists = [fallback]
    first = min(dists[0].quantile(q), item.max_tokens)
    res = first
    errs = []
    for k, d in enumerate(dists):
        res = max(res, min(d.quantile(q), item.max_tokens)) if k else res
        errs.append(abs(d.median - item.true))
    return first, res, abs(dists[0].median - item.true), float(np.mean(errs))
