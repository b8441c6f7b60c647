"""Embeddings throughput: pipellm's pooling runner against vLLM's CPU build's and llama.cpp's
`--embeddings` server, on the same model and machine with the same client (issue 50).

Model: SmolLM2-135M-Instruct as a decoder embedder (the last token's final hidden state,
L2-normalized: what `--convert embed` makes of a causal LM); pipellm and llama.cpp serve its
GGUF (pipellm: `--runner pooling`, the GGUF names no pooling: the last token; llama.cpp:
`--embeddings --pooling last`), vLLM the GGUF's HF expansion in bf16 (`--runner pooling
--convert embed --pooler-config` LAST, `use_activation`: normalized) on every core
(`vllm-fp32`: in float32, vLLM's faster dtype where bf16 is emulated, on AVX2-only CPUs).
Inputs: the prompts and answers of data/sharegpt_samples_1024.json cut into pieces of 2,000
characters (a RAG indexer's chunks; 2,290 distinct pieces), no piece sent to a server twice, so that
no prefix cache (vLLM's) serves one from memory: --num-inputs pieces for each workload,
    single   one input a request, 32 requests in flight (a RAG indexer's stream)
    batch32  32 inputs a request, 4 requests in flight (a bulk indexer)
32 more to warm up, and --queries more cut to QUERY_CHARS for the latency of a RAG app's
question (`query`: one request at a time; p50 and p99 ms of a request, client to vectors).
The client is this script's (aiohttp, OpenAI's /v1/embeddings body, float vectors). Reported:
inputs/s per (server, workload), medians over the rounds, pipellm's ratio to each peer (for
`query`: the peer's p50 over pipellm's), and how far each server's vectors agree with
pipellm's (mean cosine over the first 16 inputs: the same pooling should give about 1).
Target: pipellm ahead of both.

    python -m bench.pooling [--rounds 1] [--servers pipellm,vllm-bf16,llamacpp] [--quick]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/pooling.py`
    sys.path.insert(0, str(ROOT))

from bench import llamacpp, servers, vs_peers  # noqa: E402
from bench.common import log, machine  # noqa: E402
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, sharegpt_pairs  # noqa: E402

WORKLOADS = {"single": (1, 32), "batch32": (32, 4)}  # name -> (inputs a request, in flight)
SERVERS = ("pipellm", "vllm-bf16", "llamacpp")
MAX_CHARS = 2000
QUERY_CHARS = 200  # a question to a RAG app: the start of a ShareGPT prompt
AGREE = 16  # inputs whose vectors are compared across servers
WARM_UP = 32  # inputs embedded before the workloads
LATENCY = ("query_p50_ms", "query_p99_ms")  # the query workload's figures (lower is better)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS),
                   help="of " + ", ".join((*SERVERS, "vllm-fp32")))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-inputs", type=int, default=1000)
    p.add_argument("--queries", type=int, default=200, help="the query workload's requests")
    p.add_argument("--quick", action="store_true", help="1 round, 64 inputs")
    p.add_argument("--llamacpp-ubatch", type=int, default=2048,
                   help="llama.cpp's -b and -ub: every input must fit one ubatch")
    args = vs_peers.with_own_flags(p, argv)
    if args.quick:
        args.rounds, args.num_inputs, args.queries = 1, 64, 32
    return args


def inputs(n: int) -> list[str]:
    """`n` ShareGPT texts: prompts and answers in turn, each cut to MAX_CHARS."""
    texts = [t[:MAX_CHARS] for pair in sharegpt_pairs(default_data_dir() / SHAREGPT_FILE)
             for t in pair if t.strip()]
    return (texts * (n // len(texts) + 1))[:n]


@dataclass
class Texts:
    """What one server is sent, no text twice (a prefix cache serves none of it from memory):
    each workload's own --num-inputs texts, the warm-up's and the questions."""

    workloads: dict[str, list[str]]
    warm_up: list[str]
    questions: list[str]


def distinct_texts(n: int, questions: int) -> Texts:
    """ShareGPT's prompts and answers cut into MAX_CHARS pieces, in order (a RAG indexer's
    chunks): n a workload, then WARM_UP, then the questions (pieces cut to QUERY_CHARS)."""
    pieces = list(dict.fromkeys(  # the data's repeated texts ("continue") once
        t[i:i + MAX_CHARS] for pair in sharegpt_pairs(default_data_dir() / SHAREGPT_FILE)
        for t in pair if t.strip() for i in range(0, len(t), MAX_CHARS)))
    need = n * len(WORKLOADS) + WARM_UP + questions
    if need > len(pieces):
        raise SystemExit(f"{need} distinct texts asked for, the data has {len(pieces)}")
    at = {wl: pieces[i * n:(i + 1) * n] for i, wl in enumerate(WORKLOADS)}
    rest = pieces[n * len(WORKLOADS):need]
    return Texts(at, rest[:WARM_UP], [q[:QUERY_CHARS] for q in rest[WARM_UP:]])


async def query_latencies(url: str, model: str, texts: list[str]) -> list[float]:
    """Seconds of each of `texts` embedded in a request of its own, one request at a time;
    raises on any failed request."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for text in texts:
            body = {"model": model, "input": text, "encoding_format": "float"}
            t0 = time.perf_counter()
            async with session.post(url + "/v1/embeddings", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
                await r.json()
            out.append(time.perf_counter() - t0)
    return out


async def embed_all(url: str, model: str, texts: list[str], per_request: int,
                    in_flight: int) -> tuple[float, list[list[float]]]:
    """(seconds, vectors in input order) of embedding `texts`, `per_request` inputs a request,
    `in_flight` requests at a time; raises on any failed request."""
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    out: list = [None] * len(chunks)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(chunks)):
        queue.put_nowait(i)

    async def worker(session):
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": model, "input": chunks[i], "encoding_format": "float"}
            async with session.post(url + "/v1/embeddings", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:300]}")
                data = (await r.json())["data"]
            out[i] = [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(in_flight)))
        seconds = time.perf_counter() - t0
    return seconds, [v for chunk in out for v in chunk]


def served_model(url: str) -> str:
    """The first model id of `url`'s /v1/models."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def make_server(args, name: str, port: int, log_path: Path) -> servers.Server:
    """Server `name` serving embeddings on `port`."""
    if name == "llamacpp":
        argv = llamacpp.server_argv(args.llamacpp_bin, args.gguf, port, args.llamacpp_threads,
                                    args.llamacpp_slots, args.llamacpp_ctx)
        ub = str(args.llamacpp_ubatch)
        argv += ["--embeddings", "--pooling", "last", "-b", ub, "-ub", ub]
        return servers.Server(name, argv, f"http://127.0.0.1:{port}{llamacpp.READY_PATH}",
                              log_path)
    args.pipellm_extra = "--runner pooling"
    args.vllm_extra = ("--runner pooling --convert embed --pooler-config "
                       "'{\"pooling_type\": \"LAST\", \"use_activation\": true}'")
    return vs_peers.make_server(args, name, port, log_path)


def serve(args, name: str, texts: Texts, rep: int) -> tuple[dict[str, float], list | None]:
    """Start `name`, warm it up, run every workload; ({workload: inputs/s, LATENCY's: ms},
    the first AGREE vectors of the first workload)."""
    port = servers.free_port()
    tag = f"{name}-rep{rep}"
    server = make_server(args, name, port, args.results_dir / f"{tag}.log")
    args.commands[name] = vs_peers.command(server, port)
    url, rates, first = f"http://127.0.0.1:{port}", {}, None
    try:
        with servers.running(server, args.ready_timeout) as startup_s:
            log(f"{tag} ready after {startup_s:.0f} s")
            model = served_model(url)
            asyncio.run(embed_all(url, model, texts.warm_up, 8, 4))
            for wl, (per_request, in_flight) in WORKLOADS.items():
                sent = texts.workloads[wl]
                seconds, vectors = asyncio.run(embed_all(url, model, sent, per_request,
                                                         in_flight))
                rates[wl] = len(sent) / seconds
                first = first or vectors[:AGREE]
                log(f"{name} {wl}: {rates[wl]:.1f} inputs/s ({seconds:.1f} s)")
            ms = np.asarray(asyncio.run(query_latencies(url, model, texts.questions))) * 1e3
            rates |= dict(zip(LATENCY, np.percentile(ms, (50, 99)).tolist(), strict=True))
            log(f"{name} query: p50 {rates[LATENCY[0]]:.1f} ms, p99 {rates[LATENCY[1]]:.1f} ms")
    except (servers.ServerError, RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
        log(f"{tag}: {exc!r}")  # a failed server reports what it measured before
    return rates, first


def agreement(vectors: dict[str, list]) -> dict[str, float]:
    """Mean cosine of each server's first vectors with pipellm's."""
    ref = vectors.get("pipellm")
    if ref is None:
        return {}
    out = {}
    for name, vs in vectors.items():
        a, b = np.asarray(ref, dtype=np.float64), np.asarray(vs, dtype=np.float64)
        if a.shape != b.shape:
            continue
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        out[name] = round(float(cos.mean()), 4)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    servers.terminate_on_sigterm()
    t0 = time.monotonic()
    vs_peers.prepare(args)
    texts = distinct_texts(args.num_inputs, args.queries)
    print(f"machine: {machine()}; {args.num_inputs} ShareGPT inputs (<= {MAX_CHARS} chars) a "
          f"workload, {args.queries} questions; "
          f"results in {args.results_dir}")
    columns = (*WORKLOADS, *LATENCY)
    runs = {s: {c: [] for c in columns} for s in args.servers}
    vectors: dict[str, list] = {}
    for rep in range(args.rounds):
        for s in args.servers:
            rates, first = serve(args, s, texts, rep)
            for wl, r in rates.items():
                runs[s][wl].append(r)
            if first is not None:
                vectors.setdefault(s, first)
    med = {s: {wl: statistics.median(v) for wl, v in r.items() if v} for s, r in runs.items()}
    print("\n| server | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for s, m in med.items():
        print(f"| {s} | " + " | ".join(f"{m[c]:.1f}" if c in m else "failed"
                                       for c in columns) + " |")
    ours = med.get("pipellm", {})
    ratios = {peer: {wl: round(ours[wl] / m[wl], 2) for wl in WORKLOADS if wl in ours and wl in m}
              | ({"query_p50": round(m[LATENCY[0]] / ours[LATENCY[0]], 2)}
                 if LATENCY[0] in ours and LATENCY[0] in m else {})
              for peer, m in med.items() if peer != "pipellm"}
    agree = agreement(vectors)
    print(f"pipellm / peer (inputs/s; query: the peer's p50 ms / pipellm's): {ratios} "
          f"(target > 1); cosine to pipellm: {agree}")
    out = {"bench": "pooling", "machine": machine(), "rounds": args.rounds,
           "inputs": args.num_inputs, "queries": args.queries, "vs_peers": ratios,
           "agreement": agree, "inputs_per_s": med,
           "commands": args.commands, "seconds": round(time.monotonic() - t0)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
