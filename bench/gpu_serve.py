"""One serving run on a GPU through the real services: `pipellm up` (gateway, tokenizers,
compute, detokenizer, embedded Redis) on a Llama-3-8B-shaped random bf16 model with the demo
tokenizer's vocabulary (every generated id decodes), then `pipellm-bench` at request rate inf
and at a fixed rate. Part of bench/gpu_suite.sh; the last line printed is one JSON object.

    python -m bench.gpu_serve [--num-prompts 512] [--input-len 512] [--output-len 256]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import log, machine
from bench.servers import Server, free_port, run_bench, running
from shared.demo_model import build_demo_tokenizer, ensure_demo_model

SHAPE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=14336, rope_theta=500000.0)
KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "p99_tpot_ms", "completed", "failed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rate", type=float, default=8.0, help="the fixed-rate run's requests/s")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--bench-timeout", type=float, default=400)
    return p.parse_args(argv)


def build_model(out: Path, context: int) -> None:
    """Random Llama-3-8B-shaped weights (bf16, made on the GPU) + the demo tokenizer."""
    tok = build_demo_tokenizer()
    cfg = transformers.LlamaConfig(**SHAPE, vocab_size=tok.get_vocab_size(),
                                   max_position_embeddings=context, tie_word_embeddings=False,
                                   bos_token_id=tok.token_to_id("<s>"),
                                   eos_token_id=tok.token_to_id("</s>"), dtype="bfloat16")
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    demo = ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, out / name)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"machine: {machine()}; {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory(prefix="pipellm-gpu-serve-") as tmp:
        model, results = Path(tmp) / "model", Path(tmp) / "results"
        build_model(model, args.context)
        port = free_port()
        argv_up = [sys.executable, "-m", "services.cli", "up", "--model", str(model),
                   "--port", str(port), "--device", "cuda", "--dtype", "bfloat16",
                   "--max-model-len", str(args.context)]
        server = Server("pipellm", argv_up, f"http://127.0.0.1:{port}/health",
                        results / "pipellm.log")
        rows = {}
        with running(server, 600) as startup_s:
            log(f"pipellm ready after {startup_s:.0f} s")
            for name, rate in (("warmup", "inf"), ("rate_inf", "inf"),
                               (f"rate_{args.rate:g}", str(args.rate))):
                n = 16 if name == "warmup" else args.num_prompts
                out = results / f"{name}.json"
                res = run_bench(args, [sys.executable, "-m", "loadgen.cli", "--base-url",
                                       f"http://127.0.0.1:{port}", "--dataset-name", "random",
                                       "--random-input-len", str(args.input_len),
                                       "--random-output-len", str(args.output_len),
                                       "--ignore-eos", "--temperature", "0", "--request-rate",
                                       rate, "--num-prompts", str(n), "--disable-tqdm",
                                       "--save-result", "--result-dir", str(results),
                                       "--result-filename", out.name], out)
                if res is not None and name != "warmup":
                    rows[name] = {k: res.get(k) for k in KEYS}
                    log(f"{name}: {json.dumps(rows[name])}")
        print(json.dumps({"device": torch.cuda.get_device_name(), "model": "llama3-8b-shape "
                          "bf16 random (demo vocab)", "input_len": args.input_len,
                          "output_len": args.output_len, "num_prompts": args.num_prompts,
                          "startup_s": round(startup_s, 1), "runs": rows}))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
