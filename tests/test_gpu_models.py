"""Issue 53's open GPU checks (marked `gpu`: skipped without CUDA, tests/conftest.py).

1. CUDA-graph replay gives the eager greedy tokens for every tiny random architecture that
   tests/test_architectures.py, tests/test_sliding_window.py and tests/test_moe.py build
   (their VARIANTS and TINY, float32), and the graph engine did replay graphs.
2. Triton kernels compiled for CUDA (not the interpreter) against their PyTorch references on
   random inputs, float32 and bf16: decode and prefill attention with Gemma 2's soft-cap, and
   the fused MoE. (GELU-tanh x mul has its own: test_kernel_activation.py::test_gpu_gelu_tanh_mul.)
3. --data-parallel-size 2 with both compute ranks on one GPU (a real stack, tests/stack.py, the
   demo model): both ranks build their KV caches there and serve one engine's greedy texts.

Each check is a helper taking the device, so that it runs on CPU too (Triton under
TRITON_INTERPRET=1): only CUDA itself is new here.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.decode_attention import (
    _decode_attention_triton,
    decode_attention,
    decode_attention_reference,
)
from pipellm.kernels.fused_moe import fused_moe, fused_moe_ref
from pipellm.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import SamplingParams
from tests.hf_models import build_hf_model
from tests.test_architectures import TINY
from tests.test_architectures import VARIANTS as ARCH_VARIANTS
from tests.test_gpu_path import _config
from tests.test_kernel_decode_attention import TOL as DECODE_TOL
from tests.test_kernel_decode_attention import make_case
from tests.test_kernel_fused_moe import SHAPES as MOE_SHAPES
from tests.test_kernel_fused_moe import _inputs as moe_inputs
from tests.test_kernel_prefill_attention import TOL as PREFILL_TOL
from tests.test_kernel_prefill_attention import (
    make_batch,
    triton_backend,  # noqa: F401  (a fixture)
)
from tests.test_moe import VARIANTS as MOE_VARIANTS
from tests.test_sliding_window import VARIANTS as WINDOW_VARIANTS

VARIANTS = {**ARCH_VARIANTS, **WINDOW_VARIANTS, **MOE_VARIANTS}  # name: (ARCHES key, overrides)

# --- 1. CUDA graphs against eager steps, every architecture -----------------------------------

PROMPT_LENS = (1, 6, 19, 40, 77, 130)  # past the windows (16, 24); 130: three 64-token chunks
MAX_TOKENS = (20, 16, 12, 8, 4, 2)  # requests finish in turn: decode batches of 6 down to 1


def graph_and_eager_tokens(model_dir, device: str = "cuda") -> dict[bool, tuple]:
    """{enforce_eager: (greedy ids of each prompt, their logprobs, whether the engine has
    graphs, how many steps replayed one)}. float32: every tiny model is float32, and none needs
    another dtype; at most 8 running (graphs of 1, 2, 4 and 8 rows), 64 tokens a step."""
    rng = random.Random(53)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENS]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True)
              for n in MAX_TOKENS]
    out = {}
    for eager in (True, False):
        engine = build_engine(_config(model_dir, device, max_running=8, enforce_eager=eager))
        graphs, replays = engine.runner.graphs, [0]
        if graphs is not None:
            def counted(batch, run=graphs.run, replays=replays):
                replays[0] += 1
                return run(batch)

            graphs.run = counted
        seqs = engine.generate(prompts, params)
        out[eager] = ([s.output_ids for s in seqs], [lp for s in seqs for lp in s.logprobs],
                      graphs is not None, replays[0])
        del engine, graphs
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(VARIANTS))
def test_cuda_graph_replay_gives_the_eager_tokens(name, tmp_path):
    arch, overrides = VARIANTS[name]
    build_hf_model(tmp_path, arch, **TINY, **overrides)
    out = graph_and_eager_tokens(tmp_path)
    (eager_ids, eager_lps, eager_graphs, _), (ids, lps, has_graphs, replays) = out[True], out[False]
    assert not eager_graphs and has_graphs and replays > 0, (has_graphs, replays)
    assert [len(i) for i in ids] == list(MAX_TOKENS)
    assert ids == eager_ids
    # tiny random models often repeat one token: the logprobs show a drift the ids may not
    # (1e-4: tests/test_gpu_path.py's bound where CUDA batch shapes differ)
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(eager_lps), rtol=0, atol=1e-4)


# --- 2. Triton kernels compiled for CUDA against their references ----------------------------

SOFTCAP = 5.0  # q is scaled so that the scores (~N(0, 4^2)) mostly exceed it


def _on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on `device`, where the public kernels run Triton: compiled, on a GPU."""
    out = [t.to(device) for t in tensors]
    assert dispatch.use_triton(out[0])
    assert device != "cuda" or os.environ.get("TRITON_INTERPRET") != "1"
    return out


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: float, what: str):
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all(), what
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol,
                               msg=lambda m: f"{what}: {m}")


def check_softcap_decode(device: str, dtype: torch.dtype, window: int) -> None:
    """The public function (its split heuristic) and 3 splits, 4 query heads a KV head (tl.dot)
    and MHA (broadcast sums), against the float32 reference on CPU copies."""
    for n_kv in (2, 8):
        q, k, v, starts, lens = make_case([1, 37, 300, 1000], n_kv, 64, dtype=dtype,
                                          seed=31 + window + n_kv)
        q = q * 4
        ref = decode_attention_reference(q.float(), k.float(), v.float(), starts, lens, 0.125,
                                         window=window, softcap=SOFTCAP)
        uncapped = decode_attention_reference(q.float(), k.float(), v.float(), starts, lens,
                                              0.125, window=window)
        assert not torch.allclose(ref, uncapped, atol=1e-2)  # the cap changes the output
        args = _on(device, q, k, v, starts, lens)
        outs = {"public": decode_attention(*args, 0.125, max_seq_len=1000, window=window,
                                           softcap=SOFTCAP),
                "3 splits": _decode_attention_triton(*args, 0.125, 1000, num_splits=3,
                                                     window=window, softcap=SOFTCAP)}
        for name, out in outs.items():
            _close(out, ref, dtype, DECODE_TOL[dtype], f"{name}, {n_kv} KV heads")


def check_softcap_prefill(device: str, dtype: torch.dtype, window: int) -> None:
    """Chunks over cached prefixes, a fresh prompt; the kernel's default blocks for the dtype."""
    q, k, v, cu, starts, ctx = make_batch((1, 5, 70, 130), (200, 13, 0, 60), 8, 2, 64, dtype,
                                          seed=13 + window, device="cpu")
    q = q * 4
    ref = prefill_attention_reference(q.float(), k.float(), v.float(), cu, starts, ctx, 0.125,
                                      window, SOFTCAP)
    uncapped = prefill_attention_reference(q.float(), k.float(), v.float(), cu, starts, ctx,
                                           0.125, window)
    assert not torch.allclose(ref, uncapped, atol=1e-2)
    out = prefill_attention(*_on(device, q, k, v, cu, starts, ctx), 0.125, max_q_len=130,
                            window=window, softcap=SOFTCAP)
    _close(out, ref, dtype, PREFILL_TOL[dtype], "prefill")


def check_fused_moe(device: str, dtype: torch.dtype) -> None:
    """tests/test_kernel_fused_moe.py's shapes and a larger prefill (block_m 64), against the
    per-expert reference in float32 on CPU; its tolerances (bf16: its half-precision test's)."""
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for seed, shape in enumerate([*MOE_SHAPES, (300, 8, 2, 256, 512)]):
        x, w13, w2, weights, ids = moe_inputs(*shape, dtype=dtype, seed=seed)
        want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        got = fused_moe(*_on(device, x, w13, w2, weights, ids))
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float().cpu(), want, **tol,
                                   msg=lambda m, s=shape: f"{s}: {m}")


DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["float32", "bfloat16"]


# triton_backend: Triton for the public functions (on CUDA what "auto" picks; on CPU the
# interpreter); interpreter_bf16_dot: a no-op on a GPU, bf16 dots under the interpreter


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_backend", "interpreter_bf16_dot")
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("check", [check_softcap_decode, check_softcap_prefill],
                         ids=["decode", "prefill"])
def test_softcap_attention_compiled(check, dtype, window):
    check("cuda", dtype, window)


@pytest.mark.gpu
@pytest.mark.usefixtures("triton_backend")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_moe_compiled(dtype):
    check_fused_moe("cuda", dtype)


# --- 3. two data-parallel ranks on one GPU --------------------------------------------------

SERVER = "gpu-dp"
DP_KV_TOKENS = 1 << 20  # 2 GiB of the demo model's float32 K/V a rank: more than the rest


def serve_two_ranks_on_one_device(model_dir, device: str = "cuda",
                                  kv_tokens: int = DP_KV_TOKENS) -> None:
    """`pipellm up --data-parallel-size 2` with one visible device, which compute_env
    (pipellm/services/supervisor.py) gives both ranks; each sizes its own cache (--kv-cache-tokens:
    with --gpu-memory-utilization each rank would count the other's memory as taken). Every
    wait has a deadline and fails with the stack's logs."""
    import openai
    import redis

    from pipellm.shared import state
    from pipellm.shared.tokenizer import decode, encode, load_tokenizer
    from tests.stack import Stack

    def used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    stack = Stack(model_dir, "--device", device, "--dtype", "float32", "--data-parallel-size",
                  "2", "--max-running", "8", "--kv-cache-tokens", str(kv_tokens),
                  "--server-id", SERVER)
    prompts = [f"Data parallel request {i} says" for i in range(12)]
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = (previous or "0").split(",")[0]  # one device
        before = used() if device == "cuda" else 0
        stack.start(timeout_s=150)  # raises with the logs if not healthy by then
        client = redis.Redis.from_url(stack.redis.url)

        def rank_stats(ready) -> list[dict]:
            deadline = time.monotonic() + 60
            while not ready(stats := [state.decode_hash(client.hgetall(
                    state.stats_key(SERVER, r))) for r in (0, 1)]):
                assert time.monotonic() < deadline, f"{stats}\n{stack.logs()}"
                time.sleep(0.2)
            return stats

        for s in rank_stats(lambda st: all("device" in s for s in st)):
            assert s["device"].split(":")[0] == device, s
            assert int(s["capacity"]) == kv_tokens, s
            assert int(s["cuda_graphs"]) == (8 if device == "cuda" else 0), s
        cfg = ModelConfig.from_path(model_dir)
        kv_bytes = kv_tokens * KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads,
                                                       cfg.head_dim, torch.float32)
        if device == "cuda":  # both caches on this device, together in its memory
            assert used() - before >= 2 * kv_bytes, (used() - before, kv_bytes, stack.logs())
        api = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                            timeout=60)

        def complete(prompt: str) -> str:
            return api.completions.create(model="demo-llama", prompt=prompt, max_tokens=32,
                                          temperature=0, extra_body={"ignore_eos": True}
                                          ).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:  # at once: routed to both ranks
            texts = list(pool.map(complete, prompts))
        stats = rank_stats(lambda st: sum(int(s.get("requests", 0)) for s in st) >= len(prompts))
    finally:
        stack.stop()
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous
    assert all(int(s["requests"]) > 0 for s in stats), stats
    tok = load_tokenizer(model_dir)
    one = build_engine(_config(model_dir, device, max_running=8))
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    seqs = one.generate([encode(tok, p) for p in prompts], params)
    assert texts == [decode(tok, s.output_ids) for s in seqs]


@pytest.mark.gpu
def test_two_data_parallel_ranks_share_one_gpu(demo_model_dir):
    serve_two_ranks_on_one_device(demo_model_dir)


# --- 4. INT4 weights on CUDA: tinygemm's tiles for few-row steps (pipellm/kernels/int4_tiles.py)
# ------

@pytest.mark.gpu
def test_int4_bf16_model_runs_tinygemm_at_few_rows_in_graphs(demo_model_dir, monkeypatch):
    """--quantization int4 --dtype bfloat16 on CUDA: steps of up to 8 rows run tinygemm, the
    others the Triton GEMV / dequantize + cuBLAS; CUDA-graph replay gives the eager tokens."""
    import pipellm.kernels.int4_gemm as int4_module

    calls = {"tinygemm": 0, "triton": 0}

    def counting(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(int4_module, "int4_tiles_gemm",
                        counting("tinygemm", int4_module.int4_tiles_gemm))
    monkeypatch.setattr(int4_module, "int4_gemm_triton",
                        counting("triton", int4_module.int4_gemm_triton))
    prompts = [[1] + [(7 * i + j) % 500 + 3 for j in range(2 + 9 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 4 * i, temperature=0, ignore_eos=True)
              for i in range(6)]  # finishing in turn: the last steps have one row
    ids = {}
    for eager in (True, False):
        engine = build_engine(_config(demo_model_dir, dtype="bfloat16", quantization="int4",
                                      enforce_eager=eager))
        ids[eager] = [s.output_ids for s in engine.generate(prompts, params)]
        del engine
    assert calls["tinygemm"] > 0 and calls["triton"] > 0, calls
    assert [len(i) for i in ids[False]] == [4 + 4 * i for i in range(6)]
    assert ids[False] == ids[True]
