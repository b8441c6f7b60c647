"""Offline throughput: the engine vs Hugging Face `generate` with static batches (on CPU, or on
a GPU with --device cuda, e.g. a Llama-3-8B-shaped model: --shape llama3-8b --dtype bfloat16).

Requests take the prompt and output token counts of the ShareGPT samples (demo tokenizer),
clipped to the model's context (prompt <= context / 2, prompt + output <= context); prompt ids
are random, as is the ~50M-parameter Llama. Greedy, ignore_eos, each request its own output
length. The baseline runs `generate` on left-padded batches of 32 in arrival order, each batch to
its longest request; only each request's own tokens count. Also times scheduler + allocator +
batch building per step with all requests running in decode (no model).

    python -m bench.offline_throughput [--quick] [--baseline-requests N] [--data FILE]
    python -m bench.offline_throughput --device cuda --shape llama3-8b --dtype bfloat16 \
        --context 2048 --hf-cache static       # the GPU suite's run (bench/gpu_suite.sh)

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/offline_throughput.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from bench.common import log, machine  # noqa: E402
from pipellm.loadgen import datasets as ds  # noqa: E402
from pipellm.services.compute.backend import build_engine  # noqa: E402
from pipellm.services.compute.batch import build_batch  # noqa: E402
from pipellm.services.compute.core.sequence import Sequence  # noqa: E402
from pipellm.services.compute.core.step import StepSample  # noqa: E402
from pipellm.services.compute.inflight import InFlight  # noqa: E402
from pipellm.services.compute.scheduling.kv_space import KVSpace  # noqa: E402
from pipellm.services.compute.scheduling.scheduler import Scheduler  # noqa: E402
from pipellm.shared.config import EngineConfig, SchedulerConfig, ServiceConfig  # noqa: E402
from pipellm.shared.demo_model import build_demo_tokenizer  # noqa: E402
from pipellm.shared.heap import settle_heap  # noqa: E402
from pipellm.shared.length_dist import LengthDist  # noqa: E402
from pipellm.shared.sampling import SamplingParams  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=1408)
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, rope_theta=500000.0)
QUICK_MODEL = dict(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256)
HF_BATCH = 32
TARGET_RATIO, TARGET_MS = 2.0, 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--baseline-requests", type=int, default=0,
                   help="HF baseline on the first N requests only (default: all); tokens/s of "
                        "that subset stands in for the whole run")
    p.add_argument("--context", type=int, default=1024, help="max_position_embeddings")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--data", type=Path, default=None,
                   help=f"ShareGPT JSON (default: {ds.default_data_dir() / ds.SHAREGPT_FILE})")
    p.add_argument("--oracle-predicted-len", action="store_true",
                   help="pass each request's true output length as predicted_len")
    p.add_argument("--overhead-steps", type=int, default=500)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads (default: all cores; 1 is steadier on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--shape", default="small", choices=["small", "llama3-8b"],
                   help="the random model: small (~50M parameters) or Llama-3-8B's")
    p.add_argument("--hf-cache", default="dynamic", choices=["dynamic", "static"],
                   help="transformers' KV cache in generate (static: its compile-friendly one)")
    p.add_argument("--quick", action="store_true", help="tiny model and workload (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.context = min(args.num_requests, 48), min(args.context, 128)
        args.max_batched_tokens = min(args.max_batched_tokens, 256)
        args.overhead_steps = min(args.overhead_steps, 50)
    args.baseline_requests = min(args.baseline_requests or args.num_requests, args.num_requests)
    args.max_running = min(args.max_running, args.max_batched_tokens)
    return args


def load_workload(args: argparse.Namespace) -> tuple[list[ds.WorkItem], str]:
    path = args.data or ds.default_data_dir() / ds.SHAREGPT_FILE
    if path.is_file():
        items = ds.load_sharegpt(path, build_demo_tokenizer(), limit=args.num_requests)
        return items, f"ShareGPT {path.name} (demo tokenizer counts)"
    print(f"WARNING: {path} not found; falling back to a synthetic workload", file=sys.stderr)
    return ds.synthetic(args.num_requests, args.seed, 240, 700), "synthetic lognormal"


def clip(items: list[ds.WorkItem], context: int) -> tuple[list[int], list[int]]:
    """(prompt lens, output lens): prompt <= context / 2, prompt + output <= context."""
    plens = [min(w.prompt_len, context // 2) for w in items]
    olens = [max(1, min(w.output_len, context - p)) for w, p in zip(items, plens, strict=True)]
    return plens, olens


def model_spec(args: argparse.Namespace) -> dict:
    return QUICK_MODEL if args.quick else LLAMA3_8B if args.shape == "llama3-8b" else MODEL


def build_model(path: Path, args: argparse.Namespace) -> int:
    cfg = transformers.LlamaConfig(**model_spec(args), max_position_embeddings=args.context,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                   dtype=args.dtype)
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # initialised where it runs: 8B parameters in seconds
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype)).eval()
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    return n


class StepTimer:
    """Wraps methods of live objects to add up their wall time (a light-weight profile)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.wrapped: list[tuple[object, str, object]] = []

    def restore(self) -> None:
        for obj, name, fn in reversed(self.wrapped):
            setattr(obj, name, fn)

    def wrap(self, obj: object, name: str, key: str) -> None:
        fn = getattr(obj, name)
        self.wrapped.append((obj, name, obj.__dict__[name] if isinstance(obj, type) else fn))

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[key] += time.perf_counter() - t

        setattr(obj, name, timed)


def run_engine(model_dir: Path, prompts: list[list[int]], olens: list[int], capacity: int,
               args: argparse.Namespace) -> dict:
    engine = build_engine(EngineConfig(
        model=str(model_dir), device=args.device, dtype=args.dtype,
        kv_cache_tokens=0 if args.device == "cuda" else capacity,  # CUDA: profiled
        scheduler=SchedulerConfig(max_batched_tokens=args.max_batched_tokens,
                                  max_running=args.max_running)))
    log(f"engine: {engine.runner.summary}")
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    timer = StepTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "commit", "update")
    timer.wrap(engine.runner, "launch", "execute")
    timer.wrap(engine.runner.model, "forward", "forward")
    if engine.runner.graphs is not None:
        timer.wrap(engine.runner.graphs, "run", "forward")
    timer.wrap(InFlight, "result", "wait")  # the host waiting for the device
    t0, c0 = time.perf_counter(), time.process_time()
    seqs = []
    for ids, n in zip(prompts, olens, strict=True):
        rid = engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                 predicted_length=n if args.oracle_predicted_len else None)
        seqs.append(engine.requests[rid])
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if steps % 200 == 0:
            log(f"engine: {steps} steps, {len(engine.requests)} requests left")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    load = round(os.getloadavg()[2], 2)  # 15-minute average: about the whole phase
    log(f"engine: done in {elapsed:.1f} s")
    assert [s.num_output for s in seqs] == olens, "engine output lengths differ from the workload"
    st = engine.stats()
    ms = defaultdict(float, {k: 1000 * v / steps for k, v in timer.total.items()})
    timer.restore()
    return dict(seconds=elapsed, cpu_seconds=cpu, tokens=sum(olens), steps=steps, load=load,
                moves=st.moves, grows_in_place=st.grows_in_place, preemptions=st.preemptions,
                ms_schedule=ms["schedule"], ms_update=ms["update"], ms_forward=ms["forward"],
                ms_execute_other=ms["execute"] - ms["forward"], ms_wait=ms["wait"],
                summary=engine.runner.summary)


def run_hf(model_dir: Path, prompts: list[list[int]], olens: list[int], args) -> dict:
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype)).to(args.device)
    model.eval()
    model.generation_config.eos_token_id = None  # else None below means "the model's EOS"
    _hf_batch(model, [prompts[0][:8]], 4, args.hf_cache)  # warm-up
    t0, c0, padded = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(prompts), HF_BATCH):
        longest = max(olens[i : i + HF_BATCH])
        _hf_batch(model, prompts[i : i + HF_BATCH], longest, args.hf_cache)
        padded += longest * len(prompts[i : i + HF_BATCH])
        log(f"HF: batch {i // HF_BATCH + 1} done ({time.perf_counter() - t0:.1f} s)")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(seconds=elapsed, cpu_seconds=cpu, tokens=sum(olens), computed_tokens=padded,
                load=round(os.getloadavg()[2], 2))


@torch.inference_mode()
def _hf_batch(model, prompts: list[list[int]], new_tokens: int, cache: str = "dynamic") -> None:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    gen = transformers.GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=new_tokens,
        cache_implementation="static" if cache == "static" else None)
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    assert out.shape[1] == width + new_tokens, "HF generate stopped early"


def measure_overhead(prompts: list[list[int]], context: int, capacity: int,
                     args: argparse.Namespace, heap: str = "settled") -> dict:
    """schedule + build_batch + update per decode step, all requests running, fake tokens;
    once the requests run, `heap` "settled" (pipellm/shared/heap.py, as compute's is once started),
    "frozen" (gc.freeze alone, compute's setting before) or "default" (CPython's)."""
    cfg = EngineConfig(scheduler=SchedulerConfig(max_batched_tokens=args.max_batched_tokens,
                                                 max_running=args.max_running))
    sched = Scheduler(cfg.scheduler, KVSpace(cfg.scheduler, capacity))
    for i, ids in enumerate(prompts[: args.max_running]):  # as LLMEngine.add_request does
        params = SamplingParams(max_tokens=context - len(ids), temperature=0, ignore_eos=True)
        sched.add(Sequence(f"r{i}", list(ids), params, seed=i, max_len=context,
                           predicted_length=LengthDist.point(cfg.default_predicted_len),
                           stop_ids=frozenset()))
    device, zeros = torch.device("cpu"), [5] * args.max_batched_tokens
    lps = [0.0] * args.max_batched_tokens

    def fake_step() -> None:
        step = sched.schedule()
        build_batch(step, device)
        n = len(step.sampled)
        sched.update(step, StepSample.of(step, zeros[:n], lps[:n]))

    while sched.waiting or any(s.pending > 1 for s in sched.running):  # prefill
        fake_step()
    if heap == "settled":
        settle_heap(ServiceConfig.gc_young_threshold)
    elif heap == "frozen":
        gc.collect()
        gc.freeze()
    running = len(sched.running)
    n_steps = min(args.overhead_steps, min(s.max_len - s.num_tokens for s in sched.running) - 1)
    moves0, times, cpu = sched.kv.stats.moves, [], []
    for _ in range(n_steps):
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        fake_step()
        times.append((time.perf_counter_ns() - t) / 1e6)
        cpu.append((time.thread_time_ns() - c) / 1e6)
    assert len(sched.running) == running
    return dict(mean=sum(times) / n_steps, p99=_p99(times), cpu_mean=sum(cpu) / n_steps,
                cpu_p99=_p99(cpu), running=running, steps=n_steps,
                moves=sched.kv.stats.moves - moves0)


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, len(xs) * 99 // 100)]


def report(args, params: int, source: str, eng: dict, hf: dict, ovh: dict) -> dict:
    eng_tps, hf_tps = eng["tokens"] / eng["seconds"], hf["tokens"] / hf["seconds"]
    eng_cpu, hf_cpu = eng["tokens"] / eng["cpu_seconds"], hf["tokens"] / hf["cpu_seconds"]
    ratio, subset = eng_tps / hf_tps, args.baseline_requests < args.num_requests
    host_ms = eng["ms_schedule"] + eng["ms_execute_other"] + eng["ms_update"]
    host_share = host_ms / (1000 * eng["seconds"] / eng["steps"])
    print(f"engine: {eng['tokens']} output tokens in {eng['seconds']:.1f} s = {eng_tps:.1f} tok/s "
          f"({eng_cpu:.1f} per CPU-second; {eng['steps']} steps; per step ms: schedule "
          f"{eng['ms_schedule']:.2f}, forward {eng['ms_forward']:.1f}, moves+batch+sample "
          f"{eng['ms_execute_other']:.2f}, commit {eng['ms_update']:.2f}, waiting for the device "
          f"{eng['ms_wait']:.2f}; host work outside the forward {host_share:.1%} of a step; "
          f"KV moves {eng['moves']}, "
          f"grows in place {eng['grows_in_place']}, preemptions {eng['preemptions']})")
    which = (f"first {args.baseline_requests} of {args.num_requests} requests, tok/s of that "
             f"subset stands in for all" if subset else f"all {args.num_requests} requests")
    print(f"HF static (batch {HF_BATCH}, {which}): {hf['tokens']} useful tokens of "
          f"{hf['computed_tokens']} generated in {hf['seconds']:.1f} s = {hf_tps:.1f} tok/s "
          f"({hf_cpu:.1f} per CPU-second)")
    print(f"ratio engine / HF static: {ratio:.2f}x wall, {eng_cpu / hf_cpu:.2f}x CPU time "
          f"(target >= {TARGET_RATIO}x: {'met' if ratio >= TARGET_RATIO else 'NOT met'})")
    print(f"scheduler + allocator + build_batch with {ovh['running']} running, {ovh['steps']} "
          f"decode steps: mean {ovh['mean']:.3f} ms, p99 {ovh['p99']:.3f} ms per step (thread "
          f"CPU time: mean {ovh['cpu_mean']:.3f}, p99 {ovh['cpu_p99']:.3f}) "
          f"(target <= {TARGET_MS} ms: {'met' if ovh['mean'] <= TARGET_MS else 'NOT met'}; "
          f"{ovh['moves']} KV moves)")
    return dict(
        engine_tok_s=round(eng_tps, 2), hf_static_tok_s=round(hf_tps, 2), ratio=round(ratio, 3),
        sched_ms_per_step_mean=round(ovh["mean"], 4), sched_ms_p99=round(ovh["p99"], 4),
        sched_cpu_ms_mean=round(ovh["cpu_mean"], 4), sched_cpu_ms_p99=round(ovh["cpu_p99"], 4),
        num_requests=args.num_requests, hf_requests=args.baseline_requests,
        hf_extrapolated=subset, model_params=params, device=args.device, dtype=args.dtype,
        hf_cache=args.hf_cache, host_ms_per_step=round(host_ms, 3),
        host_share_of_step=round(host_share, 4), wait_ms_per_step=round(eng["ms_wait"], 3),
        cpu_cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(), context=args.context,
        max_batched_tokens=args.max_batched_tokens, output_tokens=eng["tokens"],
        engine_s=round(eng["seconds"], 1), hf_s=round(hf["seconds"], 1),
        engine_tok_per_cpu_s=round(eng_cpu, 2), hf_tok_per_cpu_s=round(hf_cpu, 2),
        ratio_cpu_time=round(eng_cpu / hf_cpu, 3), engine_steps=eng["steps"],
        hf_useful_fraction=round(hf["tokens"] / hf["computed_tokens"], 3),
        kv_moves=eng["moves"], preemptions=eng["preemptions"], workload=source,
        predicted_len="oracle" if args.oracle_predicted_len else "engine default",
        load_avg_engine=eng["load"], load_avg_hf=hf["load"], quick=args.quick)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}, transformers {transformers.__version__}")
    items, source = load_workload(args)
    args.num_requests = len(items)
    args.baseline_requests = min(args.baseline_requests, len(items))
    plens, olens = clip(items, args.context)
    rng = random.Random(args.seed)
    vocab = model_spec(args)["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in plens]
    print(f"workload: {len(items)} requests from {source}, clipped to context {args.context}: "
          f"{sum(plens)} prompt tokens, {sum(olens)} output tokens "
          f"(mean {sum(olens) / len(olens):.0f}, max {max(olens)})")
    capacity = len(prompts) * args.context  # every request at full context: no preemption
    with tempfile.TemporaryDirectory(prefix="pipellm-bench-") as tmp:
        params = build_model(Path(tmp), args)
        print(f"model: random Llama, {params / 1e6:.1f}M parameters, {args.dtype} on "
              f"{args.device}, {model_spec(args)}")
        ovh = measure_overhead(prompts, args.context, capacity, args)
        log("engine: start")
        eng = run_engine(Path(tmp), prompts, olens, capacity, args)
        gc.collect()
        nb = args.baseline_requests
        log(f"HF: start, {nb} requests")
        hf = run_hf(Path(tmp), prompts[:nb], olens[:nb], args)
    print(json.dumps(report(args, params, source, eng, hf, ovh)))


if __name__ == "__main__":
    main()
