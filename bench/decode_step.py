"""One decode step of a Llama-3-8B-shaped model: eager, CUDA graph, and the memory roofline.

Random bf16 weights (std 0.02, norms ones) built directly on the GPU, no files; a KV cache sized
for the largest batch, filled with random K/V. Every sequence decodes at context 1024 (1023
cached tokens + this step's), the sequences back to back in the cache. For batch 1, 64 and 256
it times `LlamaModel.forward` (median of CUDA-event timed reps, after warm-up)
  (a) eager,
  (b) captured once in a torch.cuda.CUDAGraph (warmed up on a side stream first, static
      ForwardBatch built before capture) and replayed,
with the Triton kernels (the PyTorch reference paths sync with the host: not capturable).
Bound = (weight bytes + KV bytes read) / bandwidth, the bandwidth measured in the same run as a
1 GiB device-to-device copy ((bytes read + written) / time); "% of bound" = bound / time.
Target: >= 80% of the bound at batch 64 (PASS/MISS, graph replay and eager). --quantization
builds the projections as the server's method does (int4: groups of 128, tinygemm's tiles
beside them on CUDA); the bound then counts the bytes of the quantized layout.

    python -m bench.decode_step [--quick] [--batches 1,64,256] [--context 1024]
                                [--quantization none|int4|w8a8|fp8]

--quick: a tiny model (fp16 on CPU under TRITON_INTERPRET=1 without CUDA: eager only, timings
meaningless; with CUDA, also the graph). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as `python bench/decode_step.py`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (does not import triton)

if "--quick" in sys.argv[1:] and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels' @triton.jit runs

import triton  # noqa: E402

from pipellm.kernels import dispatch  # noqa: E402
from pipellm.services.compute.batch import build_batch  # noqa: E402
from pipellm.services.compute.core.batch import ForwardBatch  # noqa: E402
from pipellm.services.compute.core.sequence import SeqStatus, Sequence  # noqa: E402
from pipellm.services.compute.core.step import ScheduledStep, WorkItem  # noqa: E402
from pipellm.services.compute.kv.kv_cache import KVCache  # noqa: E402
from pipellm.services.compute.model.llama import LlamaModel  # noqa: E402
from pipellm.services.compute.model.quantization import Quantization  # noqa: E402
from pipellm.shared.length_dist import LengthDist  # noqa: E402
from pipellm.shared.model_config import ModelConfig  # noqa: E402
from pipellm.shared.sampling import SamplingParams  # noqa: E402

FULL = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128)
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=16)
TARGET_PCT, TARGET_BATCH = 80.0, 64  # the GPU-path issue: >= 80% of the HBM bound


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,256", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=1024, help="KV length of every sequence")
    p.add_argument("--reps", type=int, default=20, help="timed forwards per batch and mode")
    p.add_argument("--quantization", default="none", choices=["none", "int4", "w8a8", "fp8"],
                   help="the projections' weights (--quantization; int4 in groups of 128)")
    p.add_argument("--quick", action="store_true", help="tiny model (smoke run; see docstring)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.batches, args.context, args.reps = [1, 4], min(args.context, 32), min(args.reps, 3)
    return args


def model_config(quick: bool, dtype: str) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", **(QUICK if quick else FULL),
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                       max_position_embeddings=8192, tie_word_embeddings=False,
                       attention_bias=False, dtype=dtype, eos_token_ids=(128001,),
                       bos_token_id=128000, sliding_window=None)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, quant: Quantization | None = None) -> LlamaModel:
    """Random HF-named weights on `device` (std 0.02, norms ones) -> LlamaModel, its
    projections built by `quant`. The unfused q/k/v and gate/up tensors die with the dict when
    this returns."""
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.empty(shape, dtype=dtype, device=device).normal_(
        0.0, 0.02, generator=gen)
    ones = lambda: torch.ones(cfg.hidden_size, dtype=dtype, device=device)
    N, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    w = {"model.embed_tokens.weight": rand(cfg.vocab_size, N), "model.norm.weight": ones(),
         "lm_head.weight": rand(cfg.vocab_size, N)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(cfg.num_heads * D, N),
              p + "self_attn.k_proj.weight": rand(cfg.num_kv_heads * D, N),
              p + "self_attn.v_proj.weight": rand(cfg.num_kv_heads * D, N),
              p + "self_attn.o_proj.weight": rand(N, cfg.num_heads * D),
              p + "mlp.gate_proj.weight": rand(inter, N), p + "mlp.up_proj.weight": rand(inter, N),
              p + "mlp.down_proj.weight": rand(N, inter),
              p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones()}
    return LlamaModel(cfg, w, device, max_positions, quant)


def make_batch(batch: int, ctx: int, vocab: int, device: torch.device) -> ForwardBatch:
    """All `batch` sequences decoding: sequence b holds ctx - 1 cached tokens in the slots
    [b * ctx, b * ctx + ctx - 1) and its pending token goes to slot b * ctx + ctx - 1."""
    seqs = []
    for b in range(batch):
        ids = [(b * 7919 + t * 31) % vocab for t in range(ctx)]
        seq = Sequence(f"b{b}", ids, SamplingParams(max_tokens=16), seed=b, max_len=ctx + 16,
                       predicted_length=LengthDist.point(16), stop_ids=frozenset())
        seq.num_cached, seq.kv_start, seq.kv_reserved = ctx - 1, b * ctx, ctx
        seq.status = SeqStatus.RUNNING
        seqs.append(seq)
    return build_batch(ScheduledStep([WorkItem.decode(s) for s in seqs]), device)


def time_ms(fn, cuda: bool, reps: int) -> float:
    """Median ms per call: CUDA events around each call after 3 warm-up calls (on CPU:
    perf_counter after 1)."""
    if not cuda:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def bandwidth_gbs(device: torch.device, cuda: bool) -> float:
    src = torch.empty((1 << 30) if cuda else (16 << 20), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), cuda, 20)
    return 2 * src.numel() / ms / 1e6


def capture(model: LlamaModel, batch: ForwardBatch, kv: KVCache):
    """CUDA graph of model.forward(batch, kv), as the PyTorch docs do it: warm-up iterations on
    a side stream (Triton compiles, allocator warms), then capture. -> (graph, static logits)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.forward(batch, kv)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.forward(batch, kv)
    return graph, logits


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes(model: LlamaModel, batch: int) -> int:
    """Bytes of weights one step reads: all the model's as served but the embedding, of which
    `batch` rows (the whole of it where the LM head is the embedding)."""
    if getattr(model.lm_head, "weight", None) is model.embed:
        return model.weight_bytes()
    embed_rows = batch * model.embed.shape[1] * model.embed.element_size()
    return model.weight_bytes() - nbytes(model.embed) + embed_rows


def run_batch(model, kv, cfg, batch: int, args, cuda: bool, bw: float) -> dict:
    """Times eager and graph forwards at one batch size; prints one line, returns figures."""
    fb = make_batch(batch, args.context, cfg.vocab_size, kv.k.device)  # reused by the graph
    eager_logits = model.forward(fb, kv)
    r = dict(eager_ms=time_ms(lambda: model.forward(fb, kv), cuda, args.reps))
    if cuda:
        try:  # a failed capture must not lose the eager figures
            graph, logits = capture(model, fb, kv)
            r["graph_ms"] = time_ms(graph.replay, cuda, args.reps)
            graph.replay()
            r["graph_vs_eager_max_diff"] = (logits - eager_logits).abs().max().item()
            del graph, logits
        except Exception as exc:
            print(f"CUDA graph failed at batch {batch}: {type(exc).__name__}: {exc}", flush=True)
            r["graph_error"] = str(exc)[:300]
    kv_read = batch * args.context * KVCache.bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv.k.dtype)
    r |= dict(weight_gb=weight_bytes(model, batch) / 1e9, kv_gb=kv_read / 1e9)
    r["bound_ms"] = (r["weight_gb"] + r["kv_gb"]) / bw * 1e3
    modes = [m for m in ("eager", "graph") if f"{m}_ms" in r]
    for m in modes:
        r[f"{m}_pct_bound"] = 100 * r["bound_ms"] / r[f"{m}_ms"]
    r["logits_finite"] = finite = bool(eager_logits.isfinite().all())
    times = "  ".join(f"{m} {r[f'{m}_ms']:8.3f} ms ({r[f'{m}_pct_bound']:5.1f}% of bound)"
                      for m in modes)
    diff = r.get("graph_vs_eager_max_diff")
    diff = "" if diff is None else f", graph vs eager max|diff| {diff:.2e}"
    print(f"batch {batch:4d}: {times} | bound {r['bound_ms']:7.3f} ms ({r['weight_gb']:.2f} GB "
          f"weights + {r['kv_gb']:.2f} GB KV) | logits finite {finite}{diff}", flush=True)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}


def setup(args, cuda: bool):
    """(config, model, KV cache with random K/V for max(batches) x context slots, bandwidth)."""
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float16  # the interpreter's dot: no bf16
    bw = bandwidth_gbs(device, cuda)
    cfg = model_config(args.quick, str(dtype).removeprefix("torch."))
    group = min(128, cfg.hidden_size // 2)  # --quick's hidden size is 64
    quant = Quantization(args.quantization, group, dtype)
    model = build_model(cfg, dtype, device, max_positions=args.context + 16, quant=quant)
    if cuda:
        torch.cuda.empty_cache()  # return the unfused weight copies before the cache allocates
    kv = KVCache(cfg.num_layers, max(args.batches) * args.context, cfg.num_kv_heads, cfg.head_dim,
                 dtype, device)
    kv.k.normal_()
    kv.v.normal_()
    return cfg, model, kv, bw


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dispatch.set_backend("triton")  # graphs need it: the reference paths call .tolist()/.item()
    device = torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)"
    print(f"device: {device}; torch {torch.__version__}, triton {triton.__version__}")
    if not cuda:
        print("WARNING: no CUDA device: tiny model on CPU under the Triton interpreter, eager only "
              "(CUDA graphs skipped); the timings below are meaningless")
    cfg, model, kv, bw = setup(args, cuda)
    print(f"model: {'tiny' if args.quick else 'Llama-3-8B-shaped'} random weights "
          f"{weight_bytes(model, 0) / 1e9:.2f} GB {kv.k.dtype}, quantization "
          f"{args.quantization}; KV cache {kv.k.shape[1]} slots "
          f"({2 * nbytes(kv.k) / 1e9:.2f} GB); context {args.context}; copy bandwidth "
          f"{bw:.1f} GB/s")
    res = {b: run_batch(model, kv, cfg, b, args, cuda, bw) for b in args.batches}
    tb = TARGET_BATCH if TARGET_BATCH in res else args.batches[-1]  # --quick: the largest
    verdicts = {}
    for m in ("graph", "eager"):
        pct = res[tb].get(f"{m}_pct_bound")
        if pct is not None:
            verdicts[f"batch{tb}_{m}_pct_bound>={TARGET_PCT:g}"] = v = (
                "PASS" if pct >= TARGET_PCT else "MISS")
            print(f"target batch {tb} {m} >= {TARGET_PCT:g}% of bound: {pct:.1f}% {v}")
    print(json.dumps(dict(device=device, torch=torch.__version__, triton=triton.__version__,
                          quick=args.quick, timings_meaningful=cuda, bandwidth_gbs=round(bw, 1),
                          quantization=args.quantization,
                          context=args.context, batches=res, targets=verdicts)))


if __name__ == "__main__":
    main()
