"""The GPU serving path: CUDA graphs of decode steps against eager steps, the KV cache sized by
--gpu-memory-utilization after a profiled step, the overlap schedule with real asynchronous
steps. All but the profiling batch need a CUDA device (marked `gpu`)."""

from __future__ import annotations

import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.batch import build_batch
from pipellm.services.compute.kv.kv_cache import KVCache
from pipellm.services.compute.kv.sizing import profile_batch
from pipellm.shared.config import EngineConfig
from pipellm.shared.model_config import ModelConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.steps import chunks, decodes
from tests.test_overlap import PROMPTS, _params, _run


def _floats_apart(x, floats: list[float]):
    """`x` (nested dicts, lists, tuples) with every float moved out into `floats`."""
    if isinstance(x, float):
        floats.append(x)
        return float
    if isinstance(x, dict):
        return {k: _floats_apart(v, floats) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_floats_apart(v, floats) for v in x)
    return x


def _assert_same_streams(a: dict, b: dict) -> None:
    """Same tokens, finish reasons and top ids; logprobs within 1e-4: on CUDA a row's sums
    depend on the batch it shares (cuBLAS picks its kernel by shape), and the overlap schedule
    runs other batch shapes than the plain one."""
    fa, fb = [], []
    assert _floats_apart(a, fa) == _floats_apart(b, fb)
    torch.testing.assert_close(torch.tensor(fa), torch.tensor(fb), rtol=0, atol=1e-4)


def _config(model_dir, device="cuda", **kw) -> EngineConfig:
    base = dict(model=str(model_dir), device=device, dtype="float32", max_batched_tokens=64,
                max_running=16, kv_cache_tokens=4096)
    return with_settings(EngineConfig(), **{**base, **kw})


def test_the_profiling_step_runs_the_largest_chunk(demo_model_dir):
    """What the GPU sizing runs, on the CPU: one chunk, logits for the last rows."""
    engine = build_engine(_config(demo_model_dir, "cpu"))
    cfg = ModelConfig.from_path(demo_model_dir)
    kv = KVCache(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    logits = engine.runner.model.forward(profile_batch(64, 16, torch.device("cpu")), kv)
    assert logits.shape == (16, cfg.vocab_size) and torch.isfinite(logits).all()
    assert kv.k[:, :64].abs().sum() > 0 and kv.nbytes() == 64 * KVCache.bytes_per_token(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_tokens(demo_model_dir):
    prompts = [[1] + [(5 * i + j) % 700 + 3 for j in range(3 + 7 * i)] for i in range(11)]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True)
    out = {}
    for eager in (True, False):
        engine = build_engine(_config(demo_model_dir, enforce_eager=eager))
        assert (engine.runner.graphs is None) == eager
        out[eager] = [[s.output_ids for s in engine.generate(prompts, p)]
                      for p in (greedy, sampled)]
    assert out[False] == out[True]


@pytest.mark.gpu
def test_a_graph_replay_matches_the_eager_forward_with_padding(demo_model_dir):
    engine = build_engine(_config(demo_model_dir, overlap_schedule="off"))
    graphs = engine.runner.graphs
    assert 3 not in graphs.sizes  # 3 rows replay the graph of 4, one row padded
    for i in range(3):
        engine.add_request([1, 9, 8, 7 + i], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prefills (eager), committed
    step = engine.scheduler.schedule()
    assert len(decodes(step)) == 3 and not chunks(step)
    batch = build_batch(step, engine.runner.device)
    logits, _ = graphs.run(batch)
    torch.testing.assert_close(logits.clone(),
                               engine.runner.model.forward(batch, engine.runner.kv),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_kv_cache_fills_what_gpu_memory_utilization_leaves(demo_model_dir):
    engine = build_engine(_config(demo_model_dir, kv_cache_tokens=0,
                                  gpu_memory_utilization=0.3))
    total = torch.cuda.get_device_properties(0).total_memory
    kv = engine.runner.kv.nbytes()
    assert 0.1 * total < kv < 0.3 * total
    assert torch.cuda.memory_allocated() < 0.3 * total
    assert "KV cache" in engine.runner.summary["gpu_memory"]


@pytest.mark.gpu
def test_overlap_on_cuda_gives_the_plain_streams(demo_model_dir):
    params = _params([504, 800])
    plain = build_engine(_config(demo_model_dir, overlap_schedule="off", kv_cache_tokens=150,
                                 max_batched_tokens=24, max_running=8, kv_min_grow=4,
                                 default_predicted_len=4))
    overlapped = build_engine(_config(demo_model_dir, kv_cache_tokens=150,
                                      max_batched_tokens=24, max_running=8, kv_min_grow=4,
                                      default_predicted_len=4))
    assert overlapped.overlap  # auto: on for CUDA
    _assert_same_streams(_run(overlapped, params), _run(plain, params))
    assert len(PROMPTS) == len(params)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verify_steps_replay_in_cuda_graphs(demo_model_dir, method):
    """A speculative verify step is decode-only (k + 1 rows a request): a graph replays it,
    and the tokens are the eager engine's and plain decoding's; a draft model's own passes
    run eagerly beside it."""
    import json

    spec = {"num_speculative_tokens": 3, "disable_by_batch_size": 16,
            **({"method": "ngram", "prompt_lookup_min": 1} if method == "ngram"
               else {"model": str(demo_model_dir)})}
    prompts = [[1] + [(5 * i + j) % 40 + 3 for j in range(8)] * 3 for i in range(4)]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = build_engine(_config(demo_model_dir, enforce_eager=True))
    want = [s.output_ids for s in plain.generate(prompts, greedy)]
    engine = build_engine(_config(demo_model_dir, speculative_config=json.dumps(spec)))
    replays, run = [0], engine.runner.graphs.run

    def counted(batch):
        replays[0] += batch.num_decodes > 4  # more rows than requests: verify rows
        return run(batch)

    engine.runner.graphs.run = counted
    assert [s.output_ids for s in engine.generate(prompts, greedy)] == want
    assert replays[0] > 0 and engine.stats().spec_accepted_tokens > 0


@pytest.mark.gpu
def test_beam_search_on_cuda_gives_the_cpus_beams(demo_model_dir):
    """Beam rows are decode rows in lanes (replayed by the graphs): the same beams as the
    CPU's float32 engine."""
    params = SamplingParams(max_tokens=12, beam_width=4, beam_n=4, ignore_eos=True)
    prompts = PROMPTS[:3]
    out = {}
    for device in ("cpu", "cuda"):
        engine = build_engine(_config(demo_model_dir, device))
        ids = [engine.add_request(p, params) for p in prompts]
        got = {rid: [] for rid in ids}
        while engine.has_work():
            for r in engine.step().outputs:
                got[r.request_id].append(list(r.token_ids))
        out[device] = [got[rid] for rid in ids]
    assert out["cuda"] == out["cpu"]


@pytest.mark.gpu
def test_launching_a_step_never_waits_for_the_device(demo_model_dir, monkeypatch):
    """ModelRunner.launch's invariant (the overlap schedule rests on it): queuing a step never
    waits for the device, with length probes at every token, top logprobs, logit_bias and
    sampling in the steps. torch's sync debug mode raises on any call that would wait (a list
    index or a pageable upload of the row indices did, until they went through pinned memory)."""
    engine = build_engine(_config(demo_model_dir, hidden_length=True, length_refine_every=1))
    launched = []

    def strict(launch):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                launched.append(1)
        return run

    monkeypatch.setattr(engine.runner, "launch", strict(engine.runner.launch))
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True,
                             top_logprobs=2),
              SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True,
                             logit_bias=((5, 2.0),))]
    seqs = engine.generate([[1, 5, 9, 14], [1, 7, 3]], params)
    assert len(launched) >= 8 and all(len(s.output_ids) == 8 for s in seqs)
