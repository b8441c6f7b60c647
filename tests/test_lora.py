"""LoRA adapters (issue 49): token-exact greedy output of each adapter against PEFT's
`merge_and_unload()` of it in transformers (float32, a tiny random Llama), one adapter alone
and mixed with the base and another adapter in one batch (chunked prefill; with an INT4 base,
an INT8 KV cache and preemption, against each request alone); prefix caching never shared
across adapters; the delta beside a quantized (INT4) base layer; a W8A8 base whose factors
follow SmoothQuant; a GGUF base (F32 and Q4_0
blocks); adapters loaded and unloaded at run time; start-up checks.

Two random adapters, built here with PEFT (its B factors are zeros at init: set randomly):
A is rank 8 on every projection, B rank 16 with rsLoRA on q, v and down only.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipellm.services.compute.backend import build_engine
from pipellm.services.compute.core.lora_groups import DENSE_ROWS, LoraGroups
from pipellm.services.compute.model.linear import Int4Linear
from pipellm.services.compute.model.linear.lora import LoraLinear
from pipellm.shared.config import EngineConfig
from pipellm.shared.length_predictor import length_features
from pipellm.shared.lora import (
    AdapterConfig,
    LoraError,
    LoraModule,
    adapter_scope,
    parse_lora_modules,
)
from pipellm.shared.sampling import InvalidParams, SamplingParams
from pipellm.shared.settings import with_settings
from tests.test_engine_vs_hf import hf_greedy, make_prompts

MAX_NEW = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, use_rslora, target modules, seed)
    "A": (8, 16, False, ALL, 1),
    "B": (16, 8, True, ["q_proj", "v_proj", "down_proj"], 2),
}


def build_adapter(base_dir, out_dir, rank, alpha, rslora, targets, seed):
    """A random PEFT LoRA adapter of the model at `base_dir`, saved to `out_dir`; returns the
    base with it merged (`merge_and_unload`), float32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                                            target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5 / rank ** 0.5)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(base dir, {adapter name: dir}, {"" and each adapter: HF's greedy outputs}, prompts)."""
    from tests.hf_models import build_hf_model

    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    base = build_hf_model(base_dir, "llama", initializer_range=0.1, num_key_value_heads=2)
    prompts = [p[:40] for p in make_prompts(base.config.vocab_size, seed=3)[:8]]
    expected = {"": hf_greedy(base, prompts, MAX_NEW)}
    dirs = {}
    for name, (rank, alpha, rslora, targets, seed) in ADAPTERS.items():
        dirs[name] = root / name
        merged = build_adapter(base_dir, dirs[name], rank, alpha, rslora, targets, seed)
        expected[name] = hf_greedy(merged, prompts, MAX_NEW)
    return base_dir, dirs, expected, prompts


def lora_engine(base_dir, dirs, **cfg):
    modules = " ".join(f"{n}={d}" for n, d in dirs.items())
    cfg = {"max_loras": len(dirs), "dtype": "float32", **cfg}
    config = with_settings(EngineConfig(), model=str(base_dir), device="cpu", enable_lora=True,
                           lora_modules=modules, max_lora_rank=16, **cfg)
    return build_engine(config)


def run(engine, requests: list[tuple[list[int], str]], arrive_every: int = 1):
    """Greedy outputs of (prompt, adapter) requests, added one every `arrive_every` steps (4
    up front) and run to completion."""
    outputs, rids, queue, step = {}, [], list(requests), 0
    while queue or engine.has_work():
        if queue and (len(rids) < 4 or step % arrive_every == 0):
            prompt, name = queue.pop(0)
            rids.append(engine.add_request(prompt, SamplingParams(
                max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, lora_name=name)))
        for ev in engine.step().outputs:
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
        engine.kv.allocator.check()
        step += 1
    return [outputs[r] for r in rids]


def test_adapters_change_the_output(lora_setup):
    _, _, expected, _ = lora_setup
    assert expected["A"] != expected[""] and expected["B"] != expected[""]
    assert expected["A"] != expected["B"]


@pytest.mark.parametrize("name", ["", "A", "B"])
def test_each_adapter_alone_matches_peft_merged(lora_setup, name):
    base_dir, dirs, expected, prompts = lora_setup
    engine = lora_engine(base_dir, dirs)
    assert run(engine, [(p, name) for p in prompts]) == expected[name]


def test_long_prefill_matches_peft_merged(lora_setup, tmp_path):
    """Prompts longer than DENSE_ROWS: their prefill rows go to GEMMs on a slice (the decode
    rows to the kernel); A and B still give PEFT's merged model's tokens, B in the same steps
    as the base."""
    from transformers import AutoModelForCausalLM

    base_dir, dirs, _, _ = lora_setup
    g = torch.Generator().manual_seed(4)
    prompts = [[1] + torch.randint(5, 200, (DENSE_ROWS + 40,), generator=g).tolist(),
               [1] + torch.randint(5, 200, (DENSE_ROWS + 5,), generator=g).tolist()]
    engine = lora_engine(base_dir, dirs)
    for name, (rank, alpha, rslora, targets, seed) in ADAPTERS.items():
        merged = build_adapter(base_dir, tmp_path / name, rank, alpha, rslora, targets, seed)
        want = hf_greedy(merged, prompts, MAX_NEW)
        assert run(engine, [(p, name) for p in prompts]) == want, name
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    got = run(engine, [(prompts[0], ""), (prompts[1], "B")])
    assert got[0] == hf_greedy(base, prompts[:1], MAX_NEW)[0]


def test_mixed_batch_chunked_prefill(lora_setup):
    """Base, A and B rows in the same steps, prompts chunked over several steps: every request
    gets the tokens it gets alone."""
    base_dir, dirs, expected, prompts = lora_setup
    engine = lora_engine(base_dir, dirs,
                         max_batched_tokens=24, max_running=8)
    names = ["", "A", "B"]
    requests = [(p, names[(i + k) % 3]) for k in range(3) for i, p in enumerate(prompts)]
    got = run(engine, requests, arrive_every=2)
    for (prompt, name), out in zip(requests, got, strict=True):
        assert out == expected[name][prompts.index(prompt)], (name, prompts.index(prompt))


def test_mixed_batch_int4_base_int8_kv_preemption(lora_setup):
    """An INT4 base (kept in its blocks, the deltas beside it), an INT8 KV cache too small for
    the batch (requests preempted and recomputed): every request of a mixed batch still gets
    the tokens it gets alone, and each adapter changes the output. Where the C++ block GEMMs
    run, a decode step without adapter rows takes the fused layers (model/fused_decode.py),
    one with them the layer loop."""
    from pipellm.kernels import dispatch

    base_dir, dirs, _, prompts = lora_setup
    engine = lora_engine(base_dir, dirs, quantization="int4", kv_cache_dtype="int8",
                         kv_cache_tokens=160, max_batched_tokens=32, max_running=16,
                         default_predicted_len=2, kv_min_grow=4)
    fused = engine.runner.model.fused
    assert (fused is not None) == (dispatch.block_gemm_extension(torch.zeros(1)) is not None)
    names = ["", "A", "B"]
    requests = [(p, names[(i + k) % 3]) for k in range(3) for i, p in enumerate(prompts)]
    alone = {(tuple(p), n): run(engine, [(p, n)])[0] for p, n in requests}
    assert engine.stats().preemptions == 0
    got = run(engine, requests, arrive_every=1)
    assert engine.stats().preemptions > 0
    for (prompt, name), out in zip(requests, got, strict=True):
        assert out == alone[(tuple(prompt), name)], (name, prompts.index(prompt))
    longest = tuple(max(prompts, key=len))
    assert len({tuple(alone[(longest, n)]) for n in names}) == 3


def test_max_loras_caps_the_adapters_of_the_running_batch(lora_setup):
    """--max-loras 1: base requests run beside one adapter's; a request of the other adapter
    waits in line until the first adapter's requests have left. Outputs unchanged."""
    base_dir, dirs, expected, prompts = lora_setup
    engine = lora_engine(base_dir, dirs, max_loras=1)
    names = ["A", "", "B", "A", ""]
    requests = [(prompts[i], n) for i, n in enumerate(names)]
    rids = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                 ignore_eos=True, lora_name=n))
            for p, n in requests]
    outputs, seen = {}, []
    while engine.has_work():
        for ev in engine.step().outputs:
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
        running = {s.params.lora_name for s in engine.scheduler.running} - {""}
        assert len(running) <= 1
        seen.append(running)
    assert {"A"} in seen and {"B"} in seen
    for rid, (prompt, name) in zip(rids, requests, strict=True):
        assert outputs[rid] == expected[name][prompts.index(prompt)]


def test_prefix_cache_not_shared_across_adapters(lora_setup):
    base_dir, dirs, expected, prompts = lora_setup
    engine = lora_engine(base_dir, dirs,
                         enable_prefix_caching=True)
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))  # 40 tokens
    hits = []
    for name in ["", "A", "B", "A"]:
        before = engine.stats().prefix_hits
        assert run(engine, [(prompts[i], name)]) == [expected[name][i]]
        hits.append(engine.stats().prefix_hits - before)
    assert hits[:3] == [0, 0, 0]  # the base's cached prompt serves neither adapter
    assert hits[3] > 0  # A's own cached prompt serves A


def test_lora_requests_info(lora_setup):
    """vLLM's lora_requests_info: the adapters of the running and the waiting requests, summed
    over engines by the gateway's metrics."""
    from pipellm.services.gateway.metrics import _lora_info

    base_dir, dirs, _, prompts = lora_setup
    engine = lora_engine(base_dir, dirs, max_running=1)
    for name in ("B", "", "A"):
        engine.add_request(prompts[2], SamplingParams(max_tokens=2, lora_name=name))
    engine.step()
    info = engine.lora_info()
    assert info == {"lora_running": "B", "lora_waiting": "A", "max_lora": "2",
                    "lora_loaded": "A,B"}
    (family,) = _lora_info([info, {"lora_running": "A", "lora_waiting": "", "max_lora": "2"}])
    (sample,) = family.samples
    assert sample.labels == {"max_lora": "2", "running_lora_adapters": "A,B",
                             "waiting_lora_adapters": "A"}
    assert list(_lora_info([{"running": "1"}])) == []


def test_load_and_unload_at_run_time(lora_setup):
    """An adapter loaded into a running engine serves PEFT's merged tokens; one unloaded while
    its request runs refuses new requests at once, finishes that one with its weights, then
    drops them."""
    base_dir, dirs, expected, prompts = lora_setup
    engine = lora_engine(base_dir, {"A": dirs["A"]}, max_loras=2)
    engine.adapters.load(LoraModule("B", str(dirs["B"])))
    assert run(engine, [(prompts[3], "B")]) == [expected["B"][3]]
    outputs = {}
    rid = engine.add_request(prompts[3], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                        ignore_eos=True, lora_name="A"))
    for _ in range(3):
        for ev in engine.step().outputs:
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
    engine.unload_lora("A")
    with pytest.raises(InvalidParams, match="does not exist"):
        engine.add_request(prompts[0], SamplingParams(lora_name="A"))
    model = engine.runner.model
    assert "A" in model.lora_slots  # its request still runs with it
    while engine.has_work():
        for ev in engine.step().outputs:
            outputs.setdefault(ev.request_id, []).extend(ev.token_ids)
    engine.tick()
    assert outputs[rid] == expected["A"][3]
    assert model.lora_slots == {"B": 0} and engine.adapters.names == {"B"}
    assert model.layers[0].qkv.a.shape[0] == 1  # A's slot dropped from the stacks


@pytest.mark.parametrize("other", [{"intermediate_size": 96}, {"num_hidden_layers": 3}],
                         ids=["shapes", "layers"])
def test_adapter_of_another_model_is_refused(lora_setup, tmp_path, other):
    """At start-up with a clear error; loaded at run time, with nothing of it attached."""
    from tests.hf_models import build_hf_model

    base_dir, dirs, expected, prompts = lora_setup
    build_hf_model(tmp_path / "other", "llama", num_key_value_heads=2, **other)
    build_adapter(tmp_path / "other", tmp_path / "X", 8, 16, False, ALL, 3)
    with pytest.raises(LoraError, match="do not fit|another model"):
        lora_engine(base_dir, {"X": tmp_path / "X"})
    engine = lora_engine(base_dir, {"A": dirs["A"]}, max_loras=2)
    with pytest.raises(LoraError):
        engine.adapters.load(LoraModule("X", str(tmp_path / "X")))
    assert engine.adapters.names == {"A"}
    assert engine.runner.model.lora_slots == {"A": 0}
    assert engine.runner.model.layers[1].gate_up.a.shape[0] == 1
    assert run(engine, [(prompts[3], "A")]) == [expected["A"][3]]


def test_unknown_adapter_is_refused(lora_setup):
    base_dir, dirs, _, prompts = lora_setup
    engine = lora_engine(base_dir, {"A": dirs["A"]})
    with pytest.raises(InvalidParams, match="does not exist"):
        engine.add_request(prompts[0], SamplingParams(lora_name="B"))


def test_rank_over_max_is_refused_at_startup(lora_setup):
    base_dir, dirs, _, _ = lora_setup
    with pytest.raises(LoraError, match="rank 16, over --max-lora-rank 8"):
        with_settings(EngineConfig(), model=str(base_dir), enable_lora=True, max_loras=2,
                      lora_modules=f"A={dirs['A']} B={dirs['B']}", max_lora_rank=8)
    with pytest.raises(LoraError, match="--max-cpu-loras is 1"):
        with_settings(EngineConfig(), model=str(base_dir), enable_lora=True, max_cpu_loras=1,
                      lora_modules=f"A={dirs['A']} B={dirs['B']}")
    with pytest.raises(ValueError, match="needs --enable-lora"):
        with_settings(EngineConfig(), model=str(base_dir), lora_modules=f"A={dirs['A']}")
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        with_settings(EngineConfig(), max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="simulator"):
        with_settings(EngineConfig(), backend="sim", enable_lora=True)


def test_length_features_per_adapter():
    """The length predictor learns an adapter's output lengths apart from the base's."""
    feats = {n: tuple(length_features("Tell me a story", [1, 2, 3], 64, adapter_scope("m", n)))
             for n in ("", "A", "B")}
    assert adapter_scope("m", "") == "m"
    assert len(set(feats.values())) == 3


def test_adapter_config(lora_setup):
    _, dirs, _, _ = lora_setup
    a, b = AdapterConfig.read(dirs["A"]), AdapterConfig.read(dirs["B"])
    assert (a.rank, a.scaling, a.targets) == (8, 2.0, frozenset(ALL))
    assert (b.rank, b.scaling) == (16, 8 / 4)  # rsLoRA: alpha / sqrt(r)


def test_lora_modules_flag_takes_several_values(lora_setup):
    """vLLM's `--lora-modules A=path '{"name": "B", ...}'`: one flag, several values."""
    import argparse

    from pipellm.shared.settings import add_config_args, config_from_args

    base_dir, dirs, _, _ = lora_setup
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    args = parser.parse_args(["--model", str(base_dir), "--enable-lora", "--max-loras", "2",
                              "--lora-modules", f"A={dirs['A']}",
                              json.dumps({"name": "B", "path": str(dirs["B"])})])
    config = config_from_args(EngineConfig, args)
    assert [m.name for m in parse_lora_modules(config.lora_modules)] == ["A", "B"]


def test_parse_lora_modules():
    obj = {"name": "c", "path": "/p/c", "base_model_name": "base"}
    text = f"a=/p/a  b=/p/b {json.dumps(obj)}"
    assert parse_lora_modules(text) == [LoraModule("a", "/p/a"), LoraModule("b", "/p/b"),
                                        LoraModule("c", "/p/c", "base")]
    assert parse_lora_modules(json.dumps([obj])) == [LoraModule("c", "/p/c", "base")]
    assert parse_lora_modules("") == []
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules("a=/x a=/y")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules("a")


def test_delta_beside_an_int4_base_layer():
    """The INT4 layer serves as is; each adapter's rows get exactly their delta added, base
    rows and the rows of an adapter not on this layer nothing, in any order, and a long run of
    one adapter (a prefill chunk: GEMMs on its slice) as the rest; a dropped slot takes its
    factors with it and the slots after it move down."""
    torch.manual_seed(0)
    base = Int4Linear(torch.randn(48, 64))
    layer = LoraLinear(base)
    factors = {n: (torch.randn(64, r), torch.randn(r, 48)) for n, r in (("A", 4), ("B", 20))}
    for n in ("A", "B", "C"):  # C does not target this projection: zeros in its slot
        layer.append(factors.get(n), torch.empty(0))
    assert layer.a.shape == (3, 64, 32) and layer.targeted == {0, 1}  # rank padded to 32
    long = ["B"] * 5 + ["A"] * DENSE_ROWS + ["", "B", "A"] + ["C"] * DENSE_ROWS
    x = torch.randn(len(long), 64)

    def check(slots: dict[str, int]) -> None:
        for names in (["", "A", "A", "B", "", "B", "A"], ["B", "A", "A", "B", "A", "B", "C"],
                      ["", "C", "", "", "C", "", ""], long):
            names = [n if n in slots else "" for n in names]
            lora = LoraGroups.of(names, slots)
            rows = x[: len(names)]
            want = base(rows)
            for i, n in enumerate(names):
                if n in factors:
                    a, b = factors[n]
                    want[i] += rows[i] @ a @ b
            torch.testing.assert_close(layer(rows, lora), want, rtol=1e-5, atol=1e-4)

    check({"A": 0, "B": 1, "C": 2})
    lora = LoraGroups.of(long, {"A": 0, "B": 1, "C": 2})
    assert lora.dense == ((0, 5, 5 + DENSE_ROWS), (2, 8 + DENSE_ROWS, 8 + 2 * DENSE_ROWS))
    assert lora.rows.tolist() == [0, 1, 2, 3, 4, 6 + DENSE_ROWS, 7 + DENSE_ROWS]
    assert lora.slots.tolist() == [1, 0] and lora.active == {0, 1, 2}
    layer.drop(0)
    assert layer.a.shape[0] == 2 and layer.targeted == {0}
    check({"B": 0, "C": 1})
    assert LoraGroups.of(["", ""], {}) is None
    torch.testing.assert_close(layer(x), base(x))


def _prompt_logprob_deltas(engine, prompts) -> dict[str, torch.Tensor]:
    """Per adapter: its prompt log-probabilities minus the base's, all prompts' tokens."""
    def scored(name):
        seqs = engine.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                       lora_name=name))
        return torch.tensor([lp for s in seqs for lp in s.prompt_logprobs[1:]])

    base = scored("")
    return {n: scored(n) - base for n in engine.runner.model.lora_slots}


def test_w8a8_base_factors_follow_smoothquant(lora_setup, monkeypatch):
    """Over a W8A8 base (SmoothQuant folded into its weights) what each adapter changes in the
    prompts' log-probabilities is what it changes on the float base (measured: cosine 0.9993;
    factors not following the smoothing: 0.54 and 0.68), and a mixed batch gives every request
    its tokens alone."""
    from pipellm.services.compute.lora import attach

    base_dir, dirs, _, prompts = lora_setup
    want = _prompt_logprob_deltas(lora_engine(base_dir, dirs), prompts)
    engine = lora_engine(base_dir, dirs, quantization="w8a8")
    assert engine.runner.model.smoothing is not None
    for name, got in _prompt_logprob_deltas(engine, prompts).items():
        assert torch.nn.functional.cosine_similarity(got, want[name], dim=0) > 0.995, name
    alone = [run(engine, [(p, n)])[0] for p in prompts[:3] for n in ("", "A", "B")]
    assert run(engine, [(p, n) for p in prompts[:3] for n in ("", "A", "B")]) == alone
    monkeypatch.setattr(attach, "_follow_smoothing", lambda a, b, *_: (a, b))
    unfollowed = _prompt_logprob_deltas(lora_engine(base_dir, dirs, quantization="w8a8"),
                                        prompts)
    assert torch.nn.functional.cosine_similarity(unfollowed["A"], want["A"], dim=0) < 0.9


def test_bf16_base_on_amx_tiles(lora_setup):
    """A bfloat16 model on a CPU at the `amx` level: its projections' stacks are packed for the
    kernel's AMX variant, and what each adapter changes in the prompts' log-probabilities is
    what it changes in float32; a mixed batch gives every request its tokens alone."""
    from pipellm.kernels.cpu import isa

    if isa.selected() != "amx":
        pytest.skip(f"the kernels do not run the amx level here ({isa.describe()})")
    base_dir, dirs, _, prompts = lora_setup
    want = _prompt_logprob_deltas(lora_engine(base_dir, dirs), prompts)
    engine = lora_engine(base_dir, dirs, dtype="bfloat16")
    assert all(layer.qkv.packed is not None for layer in engine.runner.model.layers)
    for name, got in _prompt_logprob_deltas(engine, prompts).items():
        assert torch.nn.functional.cosine_similarity(got, want[name], dim=0) > 0.99, name
    alone = [run(engine, [(p, n)])[0] for p in prompts[:3] for n in ("", "A", "B")]
    assert run(engine, [(p, n) for p in prompts[:3] for n in ("", "A", "B")]) == alone


def test_gguf_base(tmp_path):
    """A PEFT adapter over a GGUF base (the same weights written as llama.cpp's converter
    does, q and k rows permuted): PEFT's merged tokens on an F32 file; over Q4_0 blocks (served
    as INT4 as they are) the adapter still changes the output, alone as in a mixed batch."""
    from tests.gguf_files import Q, write_gguf
    from tests.hf_models import build_hf_model

    base = build_hf_model(tmp_path / "hf", "llama", with_tokenizer=True, initializer_range=0.1,
                          num_key_value_heads=2)
    merged = build_adapter(tmp_path / "hf", tmp_path / "A", 8, 16, True, ALL, 1)
    prompts = [[1, 5, 9, 200, 17], [1] + list(range(100, 130))]
    want = hf_greedy(merged, prompts, MAX_NEW)
    f32 = write_gguf(tmp_path / "f32.gguf", base, Q.F32)
    engine = lora_engine(f32, {"A": tmp_path / "A"})
    assert run(engine, [(p, "A") for p in prompts]) == want
    q4 = write_gguf(tmp_path / "q4.gguf", base, Q.Q4_0)
    engine = lora_engine(q4, {"A": tmp_path / "A"}, quantization="int4")
    alone = [run(engine, [(p, n)])[0] for p in prompts for n in ("", "A")]
    assert alone[0] != alone[1]
    assert run(engine, [(p, n) for p in prompts for n in ("", "A")]) == alone
