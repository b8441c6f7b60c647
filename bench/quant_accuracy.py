"""Accuracy and cost of the quantized modes against the float model, on the real model
(SmolLM2-135M-Instruct, the default Q4_1 GGUF), all in one run of the engine:

- perplexity of the first --texts ShareGPT answers (prompt logprobs of answer tokens, at most
  --text-tokens each), and its ratio to the float model's;
- greedy agreement with the float model: the share of identical tokens among the first
  --agree-tokens of --prompts chat prompts (ShareGPT questions, the model's chat template);
- KV bytes per token, the KV slots a fixed budget (--kv-gib) holds, and how many requests of
  the agreement run's mean size (prompt + output) fit in it at once;
- output tok/s of the agreement run (every prompt at once, greedy) and the weights' bytes.

    python -m bench.quant_accuracy                      # ~20 min on 2 cores, every mode
    python -m bench.quant_accuracy --modes float,w8a8   # some of them
    python -m bench.quant_accuracy --quick              # a smoke run

The file is already 4-bit, so "float" is the float copy made from its blocks; "int4-gguf"
serves those blocks as they are; "int4-g32"/"int4-g64" are our own float -> INT4 quantization
of the same float weights (the GGUF expanded to an HF directory, as bench/vs_peers.py does).
FP8 runs on the CPU through PyTorch's unaccelerated kernel (slow; the accuracy is the point).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from bench.smol_model import expand_gguf
from pipellm.loadgen.datasets import SHAREGPT_FILE, default_data_dir, sharegpt_pairs
from pipellm.services.compute.backend import build_engine
from pipellm.shared import default_model
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.config import EngineConfig, SchedulerConfig
from pipellm.shared.gguf.reader import is_gguf
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import encode, load_tokenizer

_INT8_KV = {"kv_cache_dtype": "int8"}
_OURS = {"quantization": "int4", "model": "hf"}  # quantized by pipellm from the float copy
MODES = {  # name -> EngineConfig fields ("model": "hf" loads the expanded float directory)
    "float": {"quantization": "none"},
    "int8-kv": {"quantization": "none", **_INT8_KV},
    "fp8-kv": {"quantization": "none", "kv_cache_dtype": "fp8"},
    "fp16-kv": {"quantization": "none", "kv_cache_dtype": "float16"},
    "int4-gguf+fp16-kv": {"quantization": "int4", "kv_cache_dtype": "float16"},
    "w8a8": {"quantization": "w8a8"},
    "w8a8+int8-kv": {"quantization": "w8a8", **_INT8_KV},
    "int4-gguf": {"quantization": "int4"},
    "int4-gguf+int8-kv": {"quantization": "int4", **_INT8_KV},
    "int4-gguf-bf16": {"quantization": "int4", "dtype": "bfloat16", "kv_cache_dtype": "auto"},
    "int4-g32": {**_OURS, "int4_group_size": 32},
    "int4-g64": {**_OURS, "int4_group_size": 64},  # 576 = 9 x 64 (SmolLM2: not 128)
    "fp8": {"quantization": "fp8"},
    "fp8+int8-kv": {"quantization": "fp8", **_INT8_KV},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="GGUF file or HF directory (default: SmolLM2)")
    p.add_argument("--texts", type=int, default=200, help="ShareGPT answers for perplexity")
    p.add_argument("--text-tokens", type=int, default=256, help="tokens of each, at most")
    p.add_argument("--prompts", type=int, default=32, help="chat prompts for agreement")
    p.add_argument("--agree-tokens", type=int, default=64, help="greedy tokens compared")
    p.add_argument("--kv-gib", type=float, default=0.25, help="KV budget for the capacity")
    p.add_argument("--work-dir", type=Path, default=Path("~/.cache/pipellm/vs_vllm").expanduser(),
                   help="where the float HF copy of the GGUF is made once (int4-g* modes)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, float always included (of {', '.join(MODES)})")
    p.add_argument("--quick", action="store_true", help="8 texts, 8 prompts, 16 tokens")
    args = p.parse_args(argv)
    args.modes = ["float"] + [m for m in args.modes.split(",") if m and m != "float"]
    if unknown := set(args.modes) - set(MODES):
        p.error(f"unknown modes: {', '.join(sorted(unknown))}")
    if args.quick:
        args.texts, args.prompts, args.agree_tokens, args.text_tokens = 8, 8, 16, 64
    return args


def workload(args, model: str) -> tuple[list[list[int]], list[list[int]]]:
    """(perplexity texts, chat prompts) as token ids."""
    tok, template = load_tokenizer(model), load_chat_template(model)
    pairs = sharegpt_pairs(default_data_dir() / SHAREGPT_FILE, max(args.texts, args.prompts))
    texts = [encode(tok, answer)[: args.text_tokens] for _, answer in pairs[: args.texts]]
    prompts = [encode(tok, template.render([{"role": "user", "content": q[:2000]}], True),
                      add_special_tokens=False) for q, _ in pairs[: args.prompts]]
    return [t for t in texts if len(t) > 1], prompts


def measure(args, models: dict[str, str], mode: dict, texts, prompts) -> dict:
    # a float32 KV cache unless the mode names one (auto would keep it in fp16 on CPU)
    mode = {"dtype": "float32", "kv_cache_dtype": "float32", **mode,
            "model": models[mode.get("model", "gguf")]}
    engine = build_engine(EngineConfig(device="cpu", kv_cache_gib=args.kv_gib,
                                       threads=args.threads,
                                       scheduler=SchedulerConfig(max_batched_tokens=2048),
                                       **mode))
    scored = engine.generate(texts, SamplingParams(max_tokens=1, temperature=0,
                                                   prompt_logprobs=0))
    logprobs = [lp for s in scored for lp in s.prompt_logprobs]
    greedy = SamplingParams(max_tokens=args.agree_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate(prompts, greedy)
    seconds = time.perf_counter() - start
    runner = engine.runner
    mean_need = sum(len(p) + args.agree_tokens for p in prompts) / len(prompts)
    return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "scored_tokens": len(logprobs),
            "outputs": [s.output_ids for s in out], "tok_s": len(prompts) * args.agree_tokens /
            seconds, "kv_bytes_per_token": runner.kv_bytes_per_token, "kv_slots": runner.capacity,
            "requests_fit": int(runner.capacity // mean_need),
            "weights_mib": runner.model.weight_bytes() / 2**20}


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or default_model.resolve()
    models = {"gguf": model}
    if any(MODES[m].get("model") == "hf" for m in args.modes):
        models["hf"] = str(expand_gguf(Path(model), args.work_dir)) if is_gguf(model) else model
    texts, prompts = workload(args, model)
    rows = {}
    for name in args.modes:
        rows[name] = measure(args, models, MODES[name], texts, prompts)
        print(f"{name}: done", flush=True)
    ref = rows["float"]
    print(f"model {model}; {len(texts)} texts ({ref['scored_tokens']} scored tokens), "
          f"{len(prompts)} prompts x {args.agree_tokens} greedy tokens; KV budget "
          f"{args.kv_gib} GiB")
    print(f"{'mode':18} {'ppl':>8} {'ppl/float':>9} {'agree':>6} {'W MiB':>6} {'KV B/tok':>9} "
          f"{'KV slots':>9} {'fit':>4} {'tok/s':>7}")
    summary = {}
    for name, r in rows.items():
        same = sum(a == b for x, y in zip(r["outputs"], ref["outputs"], strict=True)
                   for a, b in zip(x, y, strict=True))
        agree = same / (len(prompts) * args.agree_tokens)
        summary[name] = {"perplexity": round(r["perplexity"], 4),
                         "perplexity_ratio": round(r["perplexity"] / ref["perplexity"], 4),
                         "greedy_agreement": round(agree, 4),
                         "kv_bytes_per_token": r["kv_bytes_per_token"], "kv_slots": r["kv_slots"],
                         "requests_fit": r["requests_fit"], "tok_s": round(r["tok_s"], 1),
                         "weights_mib": round(r["weights_mib"], 1)}
        s = summary[name]
        print(f"{name:18} {s['perplexity']:8.3f} {s['perplexity_ratio']:9.4f} "
              f"{agree:6.1%} {s['weights_mib']:6.1f} {s['kv_bytes_per_token']:9} {s['kv_slots']:9} "
              f"{s['requests_fit']:4} {s['tok_s']:7.1f}")
    print(json.dumps({"model": model, "texts": len(texts), "prompts": len(prompts),
                      "agree_tokens": args.agree_tokens, "kv_gib": args.kv_gib,
                      "modes": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
