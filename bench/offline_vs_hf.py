"""Offline, in-process: pipellm's engine (LLMEngine) against transformers `generate` on the
same float32 model directory (SmolLM2's GGUF expanded, as bench/vs_peers.py does), both in this
process.

Prompts are random token ids of one length, every request generates exactly `output_len`
tokens (greedy, EOS ignored). transformers runs left-padded batches of up to 32
(bench/offline_throughput.run_hf, its warm-up included); the engine gets every request at
once. Both run with the same torch thread count.

    python -m bench.offline_vs_hf [--num-prompts 64] [--threads 2] [--quick]

The last line printed is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/offline_vs_hf.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import log, machine  # noqa: E402
from bench.offline_throughput import HF_BATCH, run_hf  # noqa: E402
from bench.smol_model import default_gguf, expand_gguf  # noqa: E402
from pipellm.services.compute.backend import build_engine  # noqa: E402
from pipellm.shared.config import EngineConfig  # noqa: E402
from pipellm.shared.sampling import SamplingParams  # noqa: E402


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_engine(model_dir: Path, prompts: list[list[int]], output_len: int,
               threads: int) -> dict:
    """Output tok/s of LLMEngine with every request queued at once (after a warm-up)."""
    capacity = len(prompts) * (max(map(len, prompts)) + output_len + 16)
    engine = build_engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                    kv_cache_tokens=capacity, threads=threads))
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(s.num_output for s in seqs)
    assert tokens == output_len * len(prompts), "the engine stopped a request early"
    return dict(seconds=seconds, tokens=tokens,
                max_batched_tokens=engine.config.scheduler.max_batched_tokens)


def compare(model_dir: Path, num_prompts: int, input_len: int, output_len: int,
            threads: int, seed: int = 0) -> dict:
    """Engine and HF `generate` on the same prompts: output tok/s of each and the ratio."""
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed)
    log(f"offline: engine, {num_prompts} prompts, {input_len} in / {output_len} out")
    eng = run_engine(model_dir, prompts, output_len, threads)
    gc.collect()
    log(f"offline: transformers generate ({eng['seconds']:.1f} s for the engine)")
    hf_args = argparse.Namespace(dtype="float32", device="cpu", hf_cache="dynamic")
    hf = run_hf(model_dir, prompts, [output_len] * num_prompts, hf_args)
    eng_tps, hf_tps = eng["tokens"] / eng["seconds"], hf["tokens"] / hf["seconds"]
    return dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                torch_threads=threads, hf_batch=min(HF_BATCH, num_prompts),
                engine_max_batched_tokens=eng["max_batched_tokens"],
                engine_s=round(eng["seconds"], 2), hf_s=round(hf["seconds"], 2),
                engine_tok_s=round(eng_tps, 2), hf_tok_s=round(hf_tps, 2),
                ratio=round(eng_tps / hf_tps, 3), load_avg=round(os.getloadavg()[0], 2))


def print_offline(r: dict) -> None:
    print(f"\noffline, in-process, {r['num_prompts']} prompts x {r['input_len']} in / "
          f"{r['output_len']} out, greedy, EOS ignored, {r['torch_threads']} torch thread(s):")
    print(f"  pipellm LLMEngine (max_batched_tokens {r['engine_max_batched_tokens']}): "
          f"{r['engine_tok_s']:8.1f} output tok/s ({r['engine_s']:.1f} s)")
    print(f"  transformers generate (left-padded batch {r['hf_batch']}): "
          f"{r['hf_tok_s']:8.1f} output tok/s ({r['hf_s']:.1f} s)")
    print(f"  ratio pipellm / transformers: {r['ratio']:.2f}x")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the project's model")
    p.add_argument("--work-dir", type=Path,
                   default=Path("~/.cache/pipellm/vs_vllm").expanduser(),
                   help="where the GGUF's HF expansion is kept (shared with bench/vs_peers.py)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 8 prompts, 16 out")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_len = min(args.num_prompts, 8), 16
    mach = machine()  # before the thread count changes
    hf_dir = expand_gguf(args.gguf or default_gguf(), args.work_dir)
    r = compare(hf_dir, args.num_prompts, args.input_len, args.output_len, args.threads,
                args.seed)
    print_offline(r)
    r.update(machine=mach, model=str(hf_dir))
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
