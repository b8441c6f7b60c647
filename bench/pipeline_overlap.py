"""Pipeline overlap: one process with inline detokenization vs the pipelined services.

The same offline workload (ShareGPT prompts from `<repo>/data/`, real prompt text,
max_tokens = the real answer's token count clipped to --max-output, prompt clipped so that prompt
+ output fits the context; greedy, ignore_eos; all requests submitted at once, same order) runs
  (a) inline: one process tokenizes, adds everything to an LLMEngine and loops `engine.step()`,
      running incremental detokenization + stop matching on every token event after each step;
  (b) pipelined: the real stack (`pipellm up`: gateway, tokenizer, compute, detokenizer, Redis)
      with the same engine flags, all requests sent at once as streaming /v1/completions.
It reports tokens/s and requests/s of both, where the time goes (engine step vs the rest in (a),
CPU seconds per process in (b)) and whether both produced the same text.

    python -m bench.pipeline_overlap [--quick] [--num-requests N] [--max-output N] [--model DIR]
        [--sim-model llama-2-7b [--sim-gpu h100]]

With --sim-model both runs use the simulated GPU in real time (`--backend sim`: each step sleeps
its roofline time, the CPU work of the services is real), the talk's setting: a GPU step for the
CPU work to overlap with. The texts then come from the demo tokenizer over pseudo-random ids.

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/pipeline_overlap.py`
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402

from bench.common import log, machine  # noqa: E402
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, load_sharegpt, synthetic  # noqa: E402
from pipellm.services.compute.backend import build_engine  # noqa: E402
from pipellm.services.detokenizer.incremental import IncrementalDetokenizer  # noqa: E402
from pipellm.services.detokenizer.stop import StopMatcher  # noqa: E402
from pipellm.shared.config import EngineConfig  # noqa: E402
from pipellm.shared.demo_model import ensure_demo_model  # noqa: E402
from pipellm.shared.model_config import ModelConfig, context_length  # noqa: E402
from pipellm.shared.sampling import SamplingParams  # noqa: E402
from pipellm.shared.settings import with_settings  # noqa: E402
from pipellm.shared.tokenizer import encode, load_tokenizer  # noqa: E402
from tests.stack import Stack  # noqa: E402

TALK_CLAIM = (1.10, 1.20)  # the talk: +10-20% QPS for the pipelined services
PROMPT_TAIL = 6  # prompt ids the detokenizer gets as context
                 # (pipellm/services/tokenizer/service.py)
PROCS = ("gateway", "tokenizer-0", "compute", "detokenizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--max-output", type=int, default=128, help="clip of each answer's length")
    p.add_argument("--data", type=Path, default=default_data_dir() / SHAREGPT_FILE)
    p.add_argument("--model", type=Path, default=None, help="HF model dir (default: demo)")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--redis-max-connections", type=int, default=1024,
                   help="pool size in the services' Redis URL (redis-py's default of 100 makes "
                        "the gateway answer 503 to a burst of >100 requests); 0: the default")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="intra-op threads of the engine in both modes (OMP_NUM_THREADS for the "
                        "stack); default: torch's own (one per core)")
    p.add_argument("--sim-model", default="", help="simulate this model's GPU steps")
    p.add_argument("--sim-gpu", default="h100")
    p.add_argument("--quick", action="store_true", help="20 requests of <= 16 tokens (smoke)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_output = min(args.num_requests, 20), min(args.max_output, 16)
    args.model = Path(args.model or ensure_demo_model())
    return args


def load_workload(args, tok, context: int) -> tuple[list[tuple[str, int]], str]:
    """[(prompt text, max_tokens)]: answers clipped to --max-output, prompts to the context."""
    if args.data.is_file():
        items, source = load_sharegpt(args.data, tok, limit=args.num_requests), args.data.name
    else:
        print(f"WARNING: {args.data} not found; using a synthetic workload", file=sys.stderr)
        items, source = synthetic(args.num_requests, 0, 240, 700), "synthetic"
    work = []
    for i, w in enumerate(items):
        n = max(1, min(w.output_len, args.max_output, context // 2))
        text = w.prompt if w.prompt is not None else " ".join(["hello world"] * w.prompt_len)
        work.append((clip_prompt(tok, text or f"request {i}", context - n), n))
    return work, source


def clip_prompt(tok, text: str, limit: int) -> str:
    """The longest prefix of `text` (cut at a token boundary) that encodes to <= limit ids."""
    enc = tok.encode(text)
    while len(enc.ids) > limit:
        end = enc.offsets[limit - 1][1]
        text = text[: end if end < len(text) else len(text) - 1]  # always shorter
        enc = tok.encode(text)
    return text


def engine_flags(args) -> dict:
    """The engine settings both runs share."""
    flags = dict(device="cpu", max_batched_tokens=args.max_batched_tokens,
                 max_running=args.max_running, kv_cache_tokens=args.kv_cache_tokens)
    if args.sim_model:
        flags.update(backend="sim", sim_model=args.sim_model, sim_gpu=args.sim_gpu,
                     sim_clock="real", kv_cache_tokens=0)
    return flags


def timed(obj: object, name: str) -> list[float]:
    """Wrap method `name` of a live object; the returned list's one item adds up its wall time."""
    total, fn = [0.0], getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        total[0] += time.perf_counter() - t
        return out

    setattr(obj, name, wrapper)
    return total


def run_inline(args, work: list[tuple[str, int]]) -> dict:
    """(a): tokenize, add all, step; after every step detokenize + stop-match its events."""
    cfg = with_settings(EngineConfig(), model=str(args.model), **engine_flags(args))
    engine, tok = build_engine(cfg), load_tokenizer(args.model)
    engine.generate([encode(tok, "warm up")], SamplingParams(max_tokens=4, temperature=0))
    execute, cpu0 = timed(engine.runner, "execute"), time.process_time()
    t_step, t_detok, steps, first_token = 0.0, 0.0, 0, 0.0
    streams: dict[str, tuple[IncrementalDetokenizer, StopMatcher, list[str]]] = {}
    t0 = time.perf_counter()
    for i, (text, n) in enumerate(work):
        ids = encode(tok, text)
        rid = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                    seed=i), request_id=str(i))
        streams[rid] = (IncrementalDetokenizer(tok, ids[-PROMPT_TAIL:]), StopMatcher([]), [])
    t_tokenize, counts, texts = time.perf_counter() - t0, [0] * len(work), [""] * len(work)
    while engine.has_work():
        t1 = time.perf_counter()
        events = engine.step().outputs
        t2 = time.perf_counter()
        detokenize(events, streams, counts, texts)
        t_detok += time.perf_counter() - t2
        t_step, steps = t_step + t2 - t1, steps + 1
        if events and not first_token:
            first_token = t2 - t0
    seconds = time.perf_counter() - t0
    return dict(seconds=seconds, tokens=sum(counts), counts=counts, texts=texts,
                tokenize_s=t_tokenize, step_s=t_step, execute_s=execute[0], detok_s=t_detok,
                cpu_s=time.process_time() - cpu0, steps=steps, first_token_s=first_token)


def detokenize(events, streams: dict, counts: list[int], texts: list[str]) -> None:
    """What the detokenizer service does per token, inline: text deltas + stop matching."""
    for e in events:
        detok, stops, out = streams[e.request_id]
        counts[int(e.request_id)] += 1
        piece = detok.add(e.token_ids)
        if e.finish_reason is not None:
            piece += detok.flush()
        emitted, matched = stops.feed(piece)
        out.append(emitted)
        if e.finish_reason is not None:
            out.append("" if matched else stops.flush())
            texts[int(e.request_id)] = "".join(streams.pop(e.request_id)[2])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (including its waited-for children) from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def one_request(session, url: str, text: str, n: int, seed: int) -> tuple[str, int]:
    """A streaming completion; returns (text, usage.completion_tokens). The seed only
    matters to the simulated backend's pseudo-random tokens."""
    payload = {"prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True, "seed": seed,
               "stream": True, "stream_options": {"include_usage": True}}
    pieces, used = [], -1
    async with session.post(url + "/v1/completions", json=payload) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    return "".join(pieces), used


async def send_all(url: str, work: list[tuple[str, int]]) -> tuple[list, float, float]:
    """All requests at once: (results, seconds, unix time of the first send)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        t0, wall0 = time.perf_counter(), time.time()
        results = await asyncio.gather(*(one_request(session, url, t, n, i)
                                         for i, (t, n) in enumerate(work)))
        return results, time.perf_counter() - t0, wall0


def timeline(stack: Stack, wall0: float) -> dict:
    """Seconds after the first send until the last request was queued, and the first token."""
    client = redis.Redis.from_url(stack.redis.url, decode_responses=True)
    rows = [client.hgetall(k) for k in client.scan_iter(match="pipellm:req:*")]
    rows = [r for r in rows if float(r.get("queued_at", 0)) >= wall0]
    return dict(last_queued_s=max(float(r["queued_at"]) for r in rows) - wall0,
                first_token_s=min(float(r["first_token_at"]) for r in rows) - wall0)


def run_pipelined(args, work: list[tuple[str, int]]) -> dict:
    """(b): the real stack, same engine flags; all requests at once over HTTP (SSE)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_flags(args).items()]
    stack = Stack(args.model, *flags)
    if args.redis_max_connections:  # what an operator would put in REDIS_URL
        stack.redis.url += f"?max_connections={args.redis_max_connections}"
    try:
        stack.start()
        for i in range(4):  # warm-up: first-call costs in every service
            stack.post("/v1/completions", {"prompt": f"warm up {i}", "max_tokens": 4})
        pids = {name: stack.pid(name) for name in PROCS}
        pids.update(redis=stack.redis.proc.pid, supervisor=stack.proc.pid)
        before = {k: cpu_seconds(p) for k, p in pids.items()}
        cpu0 = time.process_time()
        results, seconds, wall0 = asyncio.run(send_all(stack.url, work))
        client = time.process_time() - cpu0
        cpu = {k: cpu_seconds(p) - before[k] for k, p in pids.items()}
        times = timeline(stack, wall0)
    finally:
        stack.stop()
    cpu["client (this process)"] = client
    counts = [used for _, used in results]
    return dict(seconds=seconds, tokens=sum(counts), counts=counts,
                texts=[t for t, _ in results], cpu=cpu, **times)


def report(args, source: str, work, a: dict, b: dict) -> dict:
    """Check both runs, print the comparison, return the headline figures."""
    n, expect = len(work), [m for _, m in work]
    for name, r in (("inline", a), ("pipelined", b)):
        bad = sum(c != m for c, m in zip(r["counts"], expect, strict=True))
        assert not bad, f"{name}: {bad} requests with a wrong number of completion tokens"
    same = sum(x == y for x, y in zip(a["texts"], b["texts"], strict=True))
    for r in (a, b):
        r["tok_s"], r["req_s"] = r["tokens"] / r["seconds"], n / r["seconds"]
    ratio, bound = b["req_s"] / a["req_s"], a["seconds"] / a["step_s"]
    print(f"(a) inline: {a['tokens']} tokens in {a['seconds']:.2f} s = {a['tok_s']:.1f} tok/s, "
          f"{a['req_s']:.2f} req/s; {a['steps']} engine.steps {a['step_s']:.2f} s (model execute "
          f"{a['execute_s']:.2f} s, scheduler {a['step_s'] - a['execute_s']:.2f} s), detok+stop "
          f"{a['detok_s']:.2f} s, tokenize+add {a['tokenize_s']:.2f} s; CPU {a['cpu_s']:.2f} s; "
          f"first token at {a['first_token_s']:.2f} s")
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in b["cpu"].items())
    print(f"(b) pipelined: {b['tokens']} tokens in {b['seconds']:.2f} s = {b['tok_s']:.1f} tok/s, "
          f"{b['req_s']:.2f} req/s; CPU s: {cpu}; total {sum(b['cpu'].values()):.2f} of "
          f"{b['seconds'] * (os.cpu_count() or 1):.2f} available; last request queued at "
          f"{b['last_queued_s']:.2f} s, first token at {b['first_token_s']:.2f} s")
    print(f"QPS (b)/(a) = {ratio:.3f} (talk: {TALK_CLAIM[0]:.2f}-{TALK_CLAIM[1]:.2f}; bound if all "
          f"but engine.step overlapped perfectly: {bound:.3f}); identical texts {same}/{n}")
    return dict(
        inline_tok_s=round(a["tok_s"], 2), pipelined_tok_s=round(b["tok_s"], 2),
        inline_req_s=round(a["req_s"], 3), pipelined_req_s=round(b["req_s"], 3),
        qps_ratio=round(ratio, 3), overlap_bound=round(bound, 3), num_requests=n,
        output_tokens=a["tokens"], model=str(args.model), sim_model=args.sim_model or None,
        sim_gpu=args.sim_gpu if args.sim_model else None, inline_s=round(a["seconds"], 2),
        pipelined_s=round(b["seconds"], 2), inline_step_s=round(a["step_s"], 2),
        inline_execute_s=round(a["execute_s"], 2), inline_detok_s=round(a["detok_s"], 2),
        inline_steps=a["steps"], pipelined_last_queued_s=round(b["last_queued_s"], 3),
        pipelined_cpu_s={k: round(v, 2) for k, v in b["cpu"].items()}, identical_texts=same,
        cpu_cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
        max_output=args.max_output, max_batched_tokens=args.max_batched_tokens,
        max_running=args.max_running, kv_cache_tokens=args.kv_cache_tokens, workload=source,
        quick=args.quick)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # (a); the stack's services inherit the env
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    print(f"machine: {machine()}")
    tok = load_tokenizer(args.model)
    context = context_length(ModelConfig.from_dir(str(args.model)), 0)
    work, source = load_workload(args, tok, context)
    plens = [len(encode(tok, t)) for t, _ in work]
    print(f"workload: {len(work)} requests from {source}, context {context}: {sum(plens)} prompt "
          f"tokens (max {max(plens)}), {sum(n for _, n in work)} output tokens "
          f"(max_tokens <= {args.max_output}); model {args.model}; engine: max_batched_tokens "
          f"{args.max_batched_tokens}, max_running {args.max_running}, kv_cache_tokens "
          f"{args.kv_cache_tokens}")
    log("(a) inline: start")
    a = run_inline(args, work)
    log(f"(a) done in {a['seconds']:.1f} s; (b) pipelined: start")
    b = run_pipelined(args, work)
    log(f"(b) done in {b['seconds']:.1f} s")
    print(json.dumps(report(args, source, work, a, b)))


if __name__ == "__main__":
    main()
