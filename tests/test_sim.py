"""The simulated compute backend: cost model vs hand calculations, KV capacity, the sim runner
inside LLMEngine, virtual-clock simulations, the roofline command, and the real-time sim in the
full services stack over HTTP."""

from __future__ import annotations

import json
import threading
import time

import pytest

from bench.virtual import max_concurrent, simulate, summarize, with_arrivals
from pipellm.kernels.kv_quant import KV_GROUP
from pipellm.services.cli import main as cli_main
from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.sim import hardware
from pipellm.services.compute.sim.cost import CostModel, fit_decode, kv_dtype_bytes
from pipellm.services.compute.sim.hardware import GiB
from pipellm.services.compute.sim.runner import cost_model, token_id
from pipellm.shared.config import EngineConfig
from pipellm.shared.length_dist import LengthDist
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.settings import with_settings
from tests.stack import Stack

L3 = 8_030_261_248  # Llama-3-8B parameters (the HF checkpoint's count)
L3_EMBED = 128256 * 4096
KV_L3 = 2 * 32 * 8 * 128 * 2  # bytes per token, bf16: 128 KiB


def ideal(gpu="h100", model="llama-3-8b", **kw) -> CostModel:
    return CostModel(gpu, model, **{"eff_bw": 1.0, "eff_flops": 1.0, "overhead_s": 0.0, **kw})


# -- hardware and cost model ---------------------------------------------------------------
def test_parameter_counts_match_the_checkpoints():
    assert hardware.model("llama-3-8b").params == L3
    assert hardware.model("llama-2-7b").params == 6_738_415_616
    assert hardware.model("llama-2-13b").params == 13_015_864_320
    assert hardware.model("mistral-7b").params == 7_248_023_552
    assert hardware.model("qwen2-7b").params == 7_615_616_512


def test_lookups_fail_listing_the_choices():
    with pytest.raises(ValueError, match="choices: h100, h200, a100"):
        hardware.gpu("b200")
    with pytest.raises(ValueError, match="llama-2-7b.*llama-3-8b"):
        hardware.model("gpt-4")
    with pytest.raises(ValueError, match="no fp8"):
        CostModel("a100", "llama-3-8b", weight_dtype="fp8")


def test_llama3_8b_decode_matches_the_brief():
    """Resident 16.06 GB, but a step reads 15.01 GB: the embedding table is gathered (T rows),
    not read; the LM head is. 15.01 GB / 3.35 TB/s = 4.48 ms (brief: 15.0 GB, 4.5 ms)."""
    cm = ideal()
    assert cm.resident_weight_bytes == 2 * L3  # 16.06 GB
    assert cm.kv_bytes_per_token == KV_L3 == 128 * 1024
    c = cm.decode(1, 1)
    assert c.weight_bytes == 2 * (L3 - L3_EMBED) + 4096 * 2  # + the one embedding row
    assert c.kv_bytes == 2 * KV_L3  # read 1 token (itself), write 1
    assert c.bound == "memory"
    assert c.time_s == pytest.approx((2 * (L3 - L3_EMBED) + 8192 + 2 * KV_L3) / 3.35e12)
    assert c.time_s == pytest.approx(4.48e-3, abs=0.01e-3)
    assert ideal("h200").decode(1, 1).time_s == pytest.approx(3.13e-3, abs=0.01e-3)
    # counting the embedding table too would give the brief's other figure, 4.8 ms
    assert 2 * L3 / 3.35e12 == pytest.approx(4.79e-3, abs=0.01e-3)


def test_kv_reads_efficiencies_and_overhead():
    cm = ideal()
    c = cm.decode(64, 2048)
    assert c.kv_bytes == 64 * 2048 * KV_L3 + 64 * KV_L3
    assert c.time_s == pytest.approx(c.bytes / 3.35e12)
    real = CostModel("h100", "llama-3-8b", eff_bw=0.5, eff_flops=0.6, overhead_s=1e-3)
    assert real.decode(64, 2048).time_s == pytest.approx(2 * c.time_s + 1e-3)
    # fp8 KV halves the KV bytes, int8 (with its fp16 scale per 8 values) takes 1.25 / 2 of
    # them; int8 weights halve the decoder-layer weights
    assert ideal(kv_dtype_bytes=1).decode(64, 2048).kv_bytes == c.kv_bytes / 2
    assert kv_dtype_bytes("int8") == 1 + 2 / KV_GROUP  # what the real INT8 cache stores
    w8 = ideal(weight_dtype="int8").decode(1, 1).weight_bytes
    m = hardware.model("llama-3-8b")
    assert w8 == m.linear_params + 2 * (m.small_params + m.lm_head_params + 4096)
    # MHA Llama-2-7B: 4x the KV per token of GQA Llama-3-8B
    assert ideal(model="llama-2-7b").kv_bytes_per_token == 4 * KV_L3


def test_paged_policy_pays_the_block_table_on_attention_reads_only():
    """--sim-paged-attn-slowdown scales what attention reads, not what a step writes, and
    only under --kv-policy paged."""
    plain = ideal().decode(64, 2048)
    paged = ideal(kv_read_factor=1.1).decode(64, 2048)
    assert paged.kv_bytes == pytest.approx(1.1 * 64 * 2048 * KV_L3 + 64 * KV_L3)
    assert paged.weight_bytes == plain.weight_bytes
    base = with_settings(EngineConfig(), backend="sim", sim_paged_attn_slowdown=1.25)
    assert cost_model(with_settings(base, kv_policy="paged")).kv_read_factor == 1.25
    assert cost_model(base).kv_read_factor == 1.0
    with pytest.raises(ValueError, match="paged-attn-slowdown"):
        with_settings(base, sim_paged_attn_slowdown=0)


def test_prefill_is_compute_bound_with_causal_attention_flops():
    cm = ideal()
    m = cm.model
    q = 4096
    c = cm.cost(prefills=[(q, 0)])
    attn = 4 * 32 * 32 * 128 * q * (q + 1) // 2
    assert c.flops == 2 * m.linear_params * q + 2 * m.lm_head_params + attn
    assert c.bound == "compute"
    assert c.time_s == pytest.approx(c.flops / 989.4e12)
    # a chunk after 1000 cached tokens attends to them too, and reads their KV
    c2 = cm.cost(prefills=[(100, 1000)], num_sampled=0)
    assert c2.flops == 2 * m.linear_params * 100 + 4 * 32 * 32 * 128 * (100 * 1000 + 5050)
    assert c2.weight_bytes == cm.body_bytes + 100 * 4096 * 2  # no sampling: no LM head
    assert c2.kv_bytes == (1100 + 100) * KV_L3
    # a KV move copies (reads and writes) the moved tokens
    assert cm.cost([10], moved_tokens=50).kv_bytes == (10 + 1 + 100) * KV_L3


def test_kv_capacity_by_hand():
    cm = ideal()
    budget = int(79.1 * GiB) * 0.9 - 2 * L3 - 2 * GiB
    assert cm.kv_capacity_tokens() == int(budget // KV_L3)
    assert 440_000 < cm.kv_capacity_tokens() < 450_000
    assert ideal("h200").kv_capacity_tokens() > 2 * cm.kv_capacity_tokens()
    with pytest.raises(ValueError, match="no room for a KV cache"):
        ideal(model="llama-3-70b").kv_capacity_tokens()
    assert ideal("h200", "llama-3-70b", weight_dtype="fp8").kv_capacity_tokens() > 100_000


def test_fit_decode_recovers_efficiency_and_overhead():
    cm = ideal()
    truth = CostModel("h100", "llama-3-8b", eff_bw=0.72, overhead_s=0.8e-3)
    samples = [(b, c, truth.decode(b, c).time_s) for b in (1, 16, 64) for c in (512, 2048)]
    fit = fit_decode(cm, samples)
    assert fit["eff_bw"] == pytest.approx(0.72)
    assert fit["overhead_s"] == pytest.approx(0.8e-3)


def test_moe_parameter_counts_total_and_active():
    q3, mx = hardware.model("qwen3-30b-a3b"), hardware.model("mixtral-8x7b")
    assert q3.params == 30_532_122_624 and q3.active_params == 3_353_032_704  # 30.5B, 3.3B
    assert mx.params == 46_702_792_704 and mx.active_params == 12_879_925_248  # 46.7B, 12.9B
    dense = hardware.model("llama-3-8b")
    assert dense.active_params == dense.params and dense.sparse_layers == 0
    with pytest.raises(ValueError, match="bad expert shape"):
        hardware.ModelSpec("x", 2, 8, 1, 1, 8, 8, 10, 16, (2,), 1, num_experts=4,
                           experts_per_tok=5, expert_intermediate=8)


def test_moe_step_reads_only_the_experts_its_tokens_touch():
    """Batch 1 reads the dense weights and k of E experts per layer; as T grows the expected
    distinct experts E (1 - (1 - k/E)^T) approach E, and the bytes all the resident ones."""
    cm = ideal(model="qwen3-30b-a3b")
    head, row = cm.head_bytes, 2048 * 2
    all_experts = 48 * 128 * cm.expert_bytes
    assert cm.expert_bytes == 3 * 2048 * 768 * 2
    assert cm.body_bytes == cm.dense_bytes + all_experts
    one = cm.decode(1, 1).weight_bytes
    assert one == pytest.approx(cm.dense_bytes + 48 * 8 * cm.expert_bytes + head + row)
    assert one < 0.11 * cm.resident_weight_bytes  # 6.1 of 61.1 GB
    assert cm.touched_experts(64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    seen = [cm.decode(b, 1).weight_bytes - b * row for b in (1, 8, 64, 512)]
    assert seen == sorted(seen) and seen[-1] == pytest.approx(cm.body_bytes + head)
    assert cm.decode(1, 1).time_s < ideal().decode(1, 1).time_s  # 1.8 ms vs 4.5 (Llama-3-8B)


def test_moe_flops_count_active_experts_and_router_and_capacity_counts_all():
    cm = ideal(model="mixtral-8x7b")
    m = cm.model
    c = cm.decode(4, 1)
    attn = 4 * 32 * 32 * 128 * 4
    router = 2 * 32 * 8 * 4096  # per token
    assert c.flops - attn == 4 * (2 * m.active_linear_params + router + 2 * m.lm_head_params)
    # = 2 x active params per token, but for the embedding (gathered) and the norms
    assert c.flops - attn == 8 * (m.active_params - m.embed_params - m.small_params)
    assert cm.resident_weight_bytes == 2 * m.params  # 93.4 GB: every expert
    with pytest.raises(ValueError, match="no room for a KV cache"):
        cm.kv_capacity_tokens()  # on one H100, although a step at batch 1 reads 25.5 GB
    h200 = ideal("h200", "mixtral-8x7b")
    budget = int(139.8 * GiB) * 0.9 - 2 * m.params - 2 * GiB
    assert h200.kv_capacity_tokens() == int(budget // (2 * 32 * 8 * 128 * 2))


def test_moe_models_by_name_in_the_engine_and_roofline(capsys):
    e = build_engine(sim_config(sim_model="Qwen3-30B-A3B"))
    assert e.model_config.vocab_size == 151936 and e.max_model_len == 40960
    assert e.runner.capacity == ideal(model="qwen3-30b-a3b").kv_capacity_tokens()
    assert cli_main(["roofline", "--gpu", "h200", "--model", "mixtral-8x7b",
                     "--batches", "1", "--contexts", "512"]) == 0
    assert "mixtral-8x7b (46.70 B params" in capsys.readouterr().out


# -- the runner inside the engine ----------------------------------------------------------
def sim_config(**kw) -> EngineConfig:
    return with_settings(EngineConfig(), backend="sim", sim_clock="virtual", **kw)


def test_engine_sim_backend_from_the_spec_and_from_a_model_dir(demo_model_dir):
    e = build_engine(sim_config())
    assert e.model_config.vocab_size == 128256 and e.max_model_len == 8192
    assert e.runner.capacity == ideal().kv_capacity_tokens()
    d = build_engine(sim_config(model=str(demo_model_dir), sim_model="llama-2-7b",
                             kv_cache_tokens=5000))
    assert d.model_config.vocab_size == 1000 and d.model_config.eos_token_ids == (2,)
    assert d.max_model_len == 4096 and d.runner.capacity == 5000
    with pytest.raises(ValueError, match=r"--backend must be one of \(.torch., .sim.\)"):
        EngineConfig(backend="gpu")


def test_sim_outputs_run_to_max_tokens_deterministically(demo_model_dir):
    cfg = sim_config(model=str(demo_model_dir), kv_cache_tokens=4096)
    params = [SamplingParams(max_tokens=n, seed=s, stop_token_ids=(5, 6))
              for n, s in ((50, 1), (200, 2), (7, 1))]
    engine = build_engine(cfg)
    seqs = engine.generate([[1, 10, 11], [1, 12], [1, 13, 14, 15]], params)
    assert [s.num_output for s in seqs] == [50, 200, 7]
    assert all(s.finish_reason == "length" for s in seqs)
    assert not {0, 1, 2, 5, 6} & {t for s in seqs for t in s.output_ids}  # no BOS/EOS/stop
    assert seqs[0].output_ids[:7] == seqs[2].output_ids  # (seed, index) -> token
    again = build_engine(cfg).generate([[1, 10, 11]], params[0])[0]
    assert again.output_ids == seqs[0].output_ids
    assert len(set(seqs[1].output_ids)) > 100  # spread over the vocabulary
    assert engine.runner.clock.now == pytest.approx(engine.runner.busy_s) and engine.runner.steps
    assert all(0 <= token_id(s, i, 7) < 7 for s in range(5) for i in range(50))


def test_real_clock_sleeps_the_modelled_time(demo_model_dir):
    cfg = with_settings(EngineConfig(), backend="sim", model=str(demo_model_dir), sim_gpu="a100",
                        sim_model="llama-2-13b", kv_cache_tokens=4096)
    engine = build_engine(cfg)
    t0 = time.perf_counter()
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=10))
    wall = time.perf_counter() - t0
    step = engine.runner.busy_s / engine.runner.steps
    assert step == pytest.approx(26.0e9 / (2.039e12 * 0.8) + 1e-3, rel=0.02)  # ~17 ms
    assert engine.runner.busy_s - 10 * 1e-3 <= wall < engine.runner.busy_s + 1.0


# -- virtual simulations -------------------------------------------------------------------
def workload(n: int, qps: float, seed: int = 0, prompt: int = 200, out: int = 100):
    import random

    rng = random.Random(seed)
    lengths = [(rng.randint(prompt // 2, prompt * 2), rng.randint(out // 2, out * 2))
               for _ in range(n)]
    return with_arrivals(lengths, qps, seed)


def test_virtual_simulation_is_deterministic_and_complete():
    cfg = sim_config(sim_gpu="a100", sim_model="llama-2-7b")
    wl = workload(300, 20.0)
    a, b = simulate(cfg, wl, seed=3), simulate(cfg, wl, seed=3)
    assert [(r.first_token, r.finish, r.token_times) for r in a] == \
        [(r.first_token, r.finish, r.token_times) for r in b]
    for r, w in zip(a, wl, strict=True):
        assert r.finish_reason == "length" and r.generated == w[2]
        assert w[0] <= r.admitted <= r.first_token <= r.finish == r.token_times[-1]
        assert r.token_times == sorted(r.token_times)
    s = summarize(a)
    assert s["completed"] == 300 and s["output_tokens"] == sum(w[2] for w in wl)
    assert s["ttft_ms_p50"] <= s["ttft_ms_p99"] and 5 < s["tpot_ms_mean"] < 50


def test_more_load_means_higher_ttft_and_more_throughput():
    cfg = sim_config(sim_gpu="a100", sim_model="llama-2-7b")
    light = summarize(simulate(cfg, workload(300, 2.0)))
    heavy = summarize(simulate(cfg, workload(300, 200.0)))
    assert heavy["ttft_ms_mean"] > 3 * light["ttft_ms_mean"]
    assert heavy["tpot_ms_mean"] > light["tpot_ms_mean"]
    assert heavy["output_tok_s"] > 3 * light["output_tok_s"]
    # the same load on a faster GPU: lower latency
    fast = summarize(simulate(sim_config(sim_gpu="h200", sim_model="llama-2-7b"),
                              workload(300, 200.0)))
    assert fast["ttft_ms_mean"] < heavy["ttft_ms_mean"]
    assert fast["tpot_ms_mean"] < heavy["tpot_ms_mean"]


def test_predicted_policy_admits_more_than_max_policy():
    """Requests ask for 1024 tokens but use ~100: `max` reserves 1024 each, `predicted` only
    the prediction (grown on demand), so it runs more requests at once and finishes sooner."""
    wl = workload(200, float("inf"), out=100)
    common = dict(sim_gpu="a100", sim_model="llama-2-7b", kv_cache_tokens=20_000)
    stats = {}
    mx = simulate(sim_config(kv_policy="max", **common), wl, engine_stats=stats, max_tokens=1024)
    assert stats["moves"] == stats["preemptions"] == 0
    pr = simulate(sim_config(kv_policy="predicted", default_predicted_len=64, **common), wl,
                  max_tokens=1024)
    for recs in (mx, pr):
        assert [r.generated for r in recs] == [w[2] for w in wl]  # ended by EOS at true length
        assert all(r.finish_reason == "stop" for r in recs)
    assert max_concurrent(mx) <= 20_000 // (1024 + 100)
    assert max_concurrent(pr) > 3 * max_concurrent(mx)
    assert summarize(pr)["duration_s"] < summarize(mx)["duration_s"] / 2


def test_a_thousand_requests_in_seconds():
    wl = workload(1000, float("inf"), prompt=250, out=300)
    t0 = time.perf_counter()
    s = summarize(simulate(sim_config(), wl))
    assert time.perf_counter() - t0 < 60  # a guard against a stall, not a speed claim
    assert s["completed"] == 1000 and s["output_tok_s"] > 5000


# -- roofline command ----------------------------------------------------------------------
def test_roofline_command(capsys):
    assert cli_main(["roofline", "--gpu", "h100,a100", "--model", "llama-3-8b",
                     "--batches", "1,256", "--contexts", "512,8192"]) == 0
    out = capsys.readouterr().out
    assert "llama-3-8b" in out and "KV capacity" in out
    data = json.loads(out.strip().splitlines()[-1])
    h100 = data["tables"][0]
    assert h100["gpu"] == "h100" and h100["weights_per_step_gb"] == pytest.approx(15.01, 1e-3)
    b1 = h100["rows"][0]
    assert (b1["batch"], b1["context"]) == (1, 512) and b1["bound"] == "memory"
    assert b1["step_ms"] == pytest.approx(4.50, abs=0.01)
    assert h100["rows"][-1]["fits"] is False  # 256 x 8192 tokens > the KV capacity
    assert cli_main(["roofline", "--gpu", "b200"]) == 2


# -- real time, in the full stack ----------------------------------------------------------
@pytest.fixture(scope="module")
def sim_stack(demo_model_dir):
    s = Stack(demo_model_dir, "--backend", "sim", "--sim-gpu", "a100", "--sim-model",
              "llama-2-13b", "--served-model-name", "sim").start()
    yield s
    s.stop()


def test_stack_with_sim_backend_answers_http(sim_stack):
    step = 26.0e9 / (2.039e12 * 0.8)  # the roofline part of a step: ~16 ms
    results: dict[int, tuple] = {}

    def complete(i: int, n: int) -> None:
        t0 = time.perf_counter()
        status, body = sim_stack.post("/v1/completions", {
            "model": "sim", "prompt": f"Request number {i} says hello", "max_tokens": n})
        results[i] = (status, body, time.perf_counter() - t0)

    threads = [threading.Thread(target=complete, args=(i, n))
               for i, n in enumerate((1, 16, 40, 40, 64))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, n in enumerate((1, 16, 40, 40, 64)):
        status, body, wall = results[i]
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == n
        assert body["choices"][0]["finish_reason"] == "length"
        assert wall >= n * step  # each step sleeps at least its roofline time
    assert results[4][2] < 64 * step * 4 + 2  # and not wildly more
    status, body = sim_stack.post("/v1/chat/completions", {
        "model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12})
    assert status == 200 and body["usage"]["completion_tokens"] == 12


def bench_sim(stack, tmp_path, prompts: int, input_len: int, output_len: int) -> dict:
    """pipellm-bench's saved result of `prompts` random requests sent at once to `stack`."""
    from pipellm.loadgen import cli

    argv = ["--base-url", stack.url, "--dataset-name", "random", "--random-input-len",
            str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--disable-tqdm", "--save-result", "--result-dir",
            str(tmp_path), "--result-filename", "r.json"]
    assert cli.main(argv) == 0
    return json.loads((tmp_path / "r.json").read_text())


def test_load_generator_against_the_sim_backend(sim_stack, tmp_path):
    """pipellm-bench over HTTP against the simulated GPU: 16 requests of 32 tokens each at
    once; each token takes at least one modelled ~16 ms step, so TPOT cannot be below that."""
    r = bench_sim(sim_stack, tmp_path, 16, 24, 32)
    assert (r["completed"], r["failed"]) == (16, 0) and r["output_lens"] == [32] * 16
    assert r["mean_tpot_ms"] >= 26.0e9 / (2.039e12 * 0.8) * 1e3 * 0.95
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"]


def test_a_burst_of_a_thousand_requests_is_queued_not_refused(sim_stack, tmp_path):
    """1,000 requests at once (the published offline benchmarks' count) with the default
    --max-pending: every one answered in full, none refused with 429 (it was 512 a gateway)."""
    r = bench_sim(sim_stack, tmp_path, 1000, 8, 2)
    assert (r["completed"], r["failed"]) == (1000, 0), [e for e in r["errors"] if e][:3]
    assert r["output_lens"] == [2] * 1000


def test_online_predictor_hook_is_asked_at_arrival_and_taught_at_finish():
    """A predictor that knows the true lengths gives exactly the oracle items' run; it is asked
    once per request in arrival order and taught each true length at finish."""
    wl = workload(60, 40.0, out=50)
    common = dict(sim_gpu="a100", sim_model="llama-2-7b", kv_cache_tokens=6000)

    class Oracle:
        def __init__(self):
            self.asked, self.taught = [], {}

        def predict(self, index):
            self.asked.append(index)
            return wl[index][2]

        def learn(self, index, output_len):
            self.taught[index] = output_len

        def refine(self, index, generated):
            return None

    hook = Oracle()
    online = simulate(sim_config(**common), wl, predictor=hook, max_tokens=400)
    items = simulate(sim_config(**common), [(*w, w[2]) for w in wl], max_tokens=400)
    assert [r.token_times for r in online] == [r.token_times for r in items]
    assert hook.asked == sorted(range(len(wl)), key=lambda i: wl[i][0])
    assert hook.taught == {i: w[2] for i, w in enumerate(wl)}


def test_refined_predictions_replace_the_prior_at_their_checkpoints():
    """A prior of 1 token, refined to the true length after the first token: the segments
    stop regrowing one step at a time (the hidden-state head's replay in bench/ablation.py)."""
    wl = workload(40, 40.0, out=120)
    common = dict(sim_gpu="a100", sim_model="llama-2-7b", kv_cache_tokens=20000,
                  kv_reserve_horizon=0, kv_min_grow=1)

    class Refined:
        def __init__(self, refine):
            self.on, self.calls = refine, []

        def predict(self, index):
            return 1

        def learn(self, index, output_len):
            pass

        def refine(self, index, generated):
            self.calls.append((index, generated))
            return LengthDist.point(wl[index][2]) if self.on and generated == 0 else None

    stats = {}
    for on in (False, True):
        hook = Refined(on)
        stats[on] = {}
        recs = simulate(sim_config(**common), wl, predictor=hook, max_tokens=400,
                        engine_stats=stats[on])
        assert all(r.generated == wl[r.index][2] for r in recs)
        assert sorted(g for i, g in hook.calls if i == 0) == list(range(wl[0][2] - 1))
    grows = {on: s["grows_in_place"] + s["moves"] for on, s in stats.items()}
    assert grows[True] < grows[False] / 4
