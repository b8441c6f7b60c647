"""A reranker's shared prefix, run once or per document: the pooling runner in process on the
default model (SmolLM2-135M-Instruct's GGUF, last-token pooling), rerank-shaped prompts in
Qwen3-Reranker's format (a system line and an instruction, the query, then one document each,
then the assistant's empty thinking), one `LLMEngine.embed` call a rerank (what compute does
with one /rerank request's documents).

The reranks are bench/rerank.py's (`bodies`): queries of ShareGPT prompts cut to 200
characters, documents of ShareGPT answers cut to --doc-chars, --docs a query, --queries
queries, every text once. Two variants on the same prompts, rounds alternating:
    shared   the default: a forward's prompts run their common prefix once
             (pooling/embedder.py, MIN_SHARED)
    whole    every prompt whole (MIN_SHARED above every prompt's length)
Reported: documents/s of each (median over --rounds), shared / whole, and the largest
difference between the two variants' vectors.

    python -m bench.pooling_prefix [--queries 8] [--docs 32] [--doc-chars 1000] [--rounds 3]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/pooling_prefix.py`
    sys.path.insert(0, str(ROOT))

from bench.common import log, machine  # noqa: E402
from bench.rerank import bodies  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--docs", type=int, default=32, help="documents a query")
    p.add_argument("--doc-chars", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from pipellm.services.compute.backend import build_engine
    from pipellm.services.compute.pooling import embedder
    from pipellm.shared.config import EngineConfig
    from pipellm.shared.default_model import cached_path, fetch
    from pipellm.shared.settings import with_settings
    from pipellm.shared.tokenizer import encode, load_tokenizer

    gguf = cached_path() or fetch()
    engine = build_engine(with_settings(EngineConfig(), model=str(gguf), runner="pooling"))
    tok = load_tokenizer(str(gguf))
    warm_up, *work = bodies(args.queries, args.docs, args.doc_chars)
    prompts = [[encode(tok, b["query"] + doc) for doc in b["documents"]] for b in work]
    tokens = sum(len(p) for r in prompts for p in r)
    shared = statistics.mean(embedder.shared_prefix(r) for r in prompts)
    print(f"machine: {machine()}; {args.queries} reranks of {args.docs} documents, {tokens} "
          f"tokens, a shared prefix of {shared:.0f} tokens on average")
    every = {"shared": embedder.MIN_SHARED, "whole": 1 << 30}
    engine.embed([encode(tok, warm_up["query"] + doc) for doc in warm_up["documents"][:4]])
    rates: dict[str, list[float]] = {v: [] for v in every}
    vectors = {}
    for rep in range(args.rounds):
        for variant, min_shared in every.items():
            embedder.MIN_SHARED = min_shared
            t0 = time.perf_counter()
            out = [engine.embed(r) for r in prompts]
            rates[variant].append(args.queries * args.docs / (time.perf_counter() - t0))
            vectors[variant] = out
            log(f"round {rep}: {variant} {rates[variant][-1]:.1f} documents/s")
    embedder.MIN_SHARED = every["shared"]
    med = {v: statistics.median(r) for v, r in rates.items()}
    diff = max((a - b).abs().max().item()
               for a, b in zip(vectors["shared"], vectors["whole"], strict=True))
    ratio = med["shared"] / med["whole"]
    print(f"documents/s: shared {med['shared']:.1f}, whole {med['whole']:.1f}: {ratio:.2f}x; "
          f"largest difference between the two variants' unit vectors {diff:.2e}")
    out = {"bench": "pooling_prefix", "machine": machine(), "queries": args.queries,
           "docs": args.docs, "tokens": tokens, "shared_prefix_tokens": round(shared, 1),
           "docs_per_s": {v: round(m, 2) for v, m in med.items()}, "ratio": round(ratio, 3),
           "max_abs_diff": diff}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
