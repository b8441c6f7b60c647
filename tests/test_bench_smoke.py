"""The simulator-side benchmarks run end to end on small inputs and end with their JSON line;
bench/vs_peers.py's (and its users') parts that need neither a peer server nor the SmolLM2
GGUF."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bench import (
    ablation,
    codec,
    gateway_receive,
    health_check,
    length_predictor,
    llamacpp,
    peers_report,
    prefix_cache,
    prefix_sim,
    serve_host,
    servers,
    vllm_cpu,
    vs_peers,
)
from pipellm.loadgen import cli

ROW_KEYS = {"name", "model", "workload", "qps_at_slo", "output_throughput", "p99_ttft_ms",
            "p99_tpot_ms", "preemptions"}


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_ablation_quick(capsys):
    ablation.main(["--models", "llama-2-7b", "--workloads", "sharegpt", "--requests", "50",
                   "--bisect", "2", "--pipeline-requests", "0"])  # --quick, smaller
    rows = last_json(capsys.readouterr().out)["rows"]
    assert [r["name"] for r in rows] == [v.name for v in ablation.VARIANTS
                                         if not v.workloads]  # the smollm2 rows need its data
    assert all(ROW_KEYS <= set(r) and r["simulated"] is True for r in rows)
    assert all(isinstance(r["preemptions_at_paged_qps"], int) for r in rows)
    by = {r["name"]: r for r in rows}
    # merged steps beat static batching; INT8 KV (1.25 bytes a value with its scales) holds
    # 1.6x the slots of the 16-bit cache
    assert by["merged steps, max-length KV"]["max_output_throughput"] > \
        by["static batching, max-length KV"]["max_output_throughput"]
    int8, fp16 = by["merged, predicted KV (learned), INT8 KV"], \
        by["merged, predicted KV (learned predictor)"]
    assert int8["kv_capacity"] == pytest.approx(1.6 * fp16["kv_capacity"], rel=1e-4)


def test_prefix_sim_quick(capsys):
    """Shared prefixes hit and cut TTFT; prompts that share nothing (the Azure control) never
    hit and lose nothing to the cache."""
    prefix_sim.main(["--quick", "--requests", "60", "--bisect", "1", "--models", "llama-3-8b"])
    out = last_json(capsys.readouterr().out)
    rows = {(r["workload"], r["caching"]): r for r in out["rows"]}
    assert rows["shared-prefix", True]["prefix_hit_rate"] > 0.5
    assert rows["multiturn", True]["prefix_hit_rate"] > 0.2
    assert rows["azure", True]["prefix_hit_rate"] == 0.0
    assert rows["shared-prefix", True]["ttft_ms_p50"] < rows["shared-prefix", False]["ttft_ms_p50"]
    assert out["qps_ratio"]["llama-3-8b"]["azure"] == pytest.approx(1.0, abs=0.05)


def test_prefix_cache_bench_workloads_and_summary():
    args = prefix_cache.parse_args(["--request-rate", "2", "--quick"])
    assert list(prefix_cache.workloads(args)) == [
        "shared-prefix@2", "shared-prefix@inf", "sharegpt-multiturn@2", "sharegpt-multiturn@inf"]
    rows = [dict(server=s, workload="w", rep=r, ok=True, median_ttft_ms=t, request_throughput=q,
                 output_throughput=1.0, failed=0)
            for s, t, q in (("pipellm", 900.0, 1.0), ("pipellm+cache", 300.0, 2.0))
            for r in range(3)]
    gain = prefix_cache.summarize(rows, ["pipellm", "pipellm+cache"])["w"]["pipellm cache gain"]
    assert gain == {"ttft_x_lower": 3.0, "qps_x": 2.0}
    assert args.rounds == 1 and args.num_prompts == 12 and "vllm+cache" in args.servers
    args.hf_dir = Path("/hf")
    argv = prefix_cache.bench_argv(args, ["--request-rate", "2"], 8001, 7, Path("/r/o.json"))
    assert argv[argv.index("--tokenizer") + 1] == "/hf" and "--ignore-eos" in argv


def test_offline_vs_hf_runs_both_on_a_tiny_model(tmp_path):
    from bench.offline_vs_hf import compare
    from tests.hf_models import build_hf_model

    build_hf_model(tmp_path, "llama")
    r = compare(tmp_path, num_prompts=3, input_len=12, output_len=5, threads=1)
    assert r["engine_tok_s"] > 0 and r["hf_tok_s"] > 0
    assert r["ratio"] == pytest.approx(r["engine_tok_s"] / r["hf_tok_s"], rel=0.01)


def test_length_predictor_bench_small(capsys):
    length_predictor.main(["--limit", "120"])
    methods = last_json(capsys.readouterr().out)["methods"]
    assert set(methods) == {"max_tokens", "global_p90", "predictor", "oracle"}
    assert methods["oracle"] == {"mae": 0.0, "outgrow_rate": 0.0, "reserved_over_used": 1.0}
    assert methods["max_tokens"]["reserved_over_used"] > methods["predictor"][
        "reserved_over_used"] > 1.0


def test_length_hidden_replays_the_refiner_on_recorded_states():
    """bench/length_hidden.run_online on recorded-like states with a planted marker: the
    head after prefill (from its 16th request on) tells short answers from long ones."""
    import numpy as np

    from bench import length_hidden

    rng = np.random.default_rng(0)
    items = []
    for i in range(64):
        short = i % 2 == 0
        true = int(rng.integers(5, 15)) if short else int(rng.integers(250, 400))
        h = 0.3 * rng.normal(size=(len(range(0, true, 32)), 16)).astype(np.float32)
        h[:, 0] = 1.0 if short else -1.0
        items.append(length_hidden.Item(40, 1024, true, h, i))
    out = length_hidden.run_online(items, 16, 32, (1.0, 0.1))  # 16: no projection
    preds = dict(out["predictions"])
    assert all(preds[i] is None for i in out["order"][:16])
    late = out["order"][40:]
    short = [preds[i][0].median for i in late if items[i].true < 20]
    long = [preds[i][0].median for i in late if items[i].true > 200]
    # (19 features from 40 requests: one odd prediction may overfit the noise)
    assert sum(x < 60 for x in short) >= len(short) - 1 and sum(x > 150 for x in long) >= \
        len(long) - 1
    assert all(len(preds[i]) == len(items[i].hidden) for i in late)


def _peers_args(tmp_path, *flags: str):
    args = vs_peers.parse_args(["--results-dir", str(tmp_path), *flags])
    args.gguf, args.hf_dir = tmp_path / "m.gguf", tmp_path / "hf"
    args.vllm_bin, args.llamacpp_bin = "/v/bin/vllm", "/l/llama-server"
    args.llamacpp_avx2_bin = "/l2/llama-server"
    return args


def test_vs_peers_args():
    args = vs_peers.parse_args([])
    assert args.servers == ["pipellm", "pipellm-avx2", "vllm-bf16", "vllm-fp32", "llamacpp",
                            "llamacpp-avx2"]
    assert (args.rounds, args.workloads, args.llamacpp_slots) == (3, ["sg", "r2", "b1"], 16)
    assert (args.sampling, args.temperature, args.top_p) == (["greedy", "sampled"], 0.7, 0.9)
    assert args.vllm_bin.endswith("peers/vllm-venv/bin/vllm") and not args.install_vllm
    quick = vs_peers.parse_args(["--quick", "--servers", "pipellm-fp32, vllm-fp32-auto"])
    assert (quick.rounds, quick.sharegpt_prompts, quick.num_prompts, quick.b1_prompts) == \
        (1, 16, 16, 4)
    assert quick.servers == ["pipellm-fp32", "vllm-fp32-auto"]
    with pytest.raises(SystemExit):
        vs_peers.parse_args(["--servers", "pipellm,ollama"])
    with pytest.raises(SystemExit):
        vs_peers.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        vs_peers.parse_args(["--sampling", "greedy,beam"])
    greedy = vs_peers.parse_args(["--sampling", "greedy", "--workloads", "b1"])
    assert vs_peers.launches(greedy, "pipellm") == [(None, ["b1"])]


def test_vs_peers_server_commands(tmp_path):
    args = _peers_args(tmp_path)
    log = tmp_path / "x.log"
    pl = vs_peers.make_server(args, "pipellm", 8001, log)
    assert pl.argv[1:] == ["up", "--model", str(tmp_path / "m.gguf"), "--port", "8001"]
    assert pl.ready_url == "http://127.0.0.1:8001/health"
    assert pl.env == {"PIPELLM_CPU_ISA": "auto"}  # never what the caller's shell has
    avx2 = vs_peers.make_server(args, "pipellm-avx2", 8001, log)
    assert (avx2.argv, avx2.env) == (pl.argv, {"PIPELLM_CPU_ISA": "avx2"})
    assert vs_peers.command(avx2, 8001).endswith("up --model " + str(tmp_path / "m.gguf")
                                                  + " --port PORT")
    assert vs_peers.command(avx2, 8001).startswith("PIPELLM_CPU_ISA=avx2 ")
    bf = vs_peers.make_server(args, "pipellm-bf16", 8001, log)
    assert bf.argv[1:] == ["up", "--model", str(tmp_path / "hf"), "--port", "8001",
                           "--dtype", "bfloat16"]
    vl = vs_peers.make_server(args, "vllm-bf16", 8002, log)
    assert vl.argv == ["/v/bin/vllm", "serve", str(tmp_path / "hf"), "--host", "127.0.0.1",
                       "--port", "8002", "--dtype", "bfloat16", "--max-model-len", "2048"]
    assert vl.ready_url.endswith("/v1/models")
    assert vl.env == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                      "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}
    auto = vs_peers.make_server(args, "vllm-fp32-auto", 8002, log)
    assert "float32" in auto.argv and "VLLM_CPU_OMP_THREADS_BIND" not in auto.env
    ll = vs_peers.make_server(args, "llamacpp", 8003, log)
    assert ll.argv == ["/l/llama-server", "-m", str(tmp_path / "m.gguf"), "--host",
                       "127.0.0.1", "--port", "8003", "-t", "2", "-np", "16", "-c", "32768"]
    assert ll.ready_url.endswith("/health")
    one = vs_peers.make_server(args, "llamacpp", 8003, log, slots=1)
    assert one.argv[one.argv.index("-np") + 1] == "1"
    l2 = vs_peers.make_server(args, "llamacpp-avx2", 8003, log)
    assert l2.argv == ["/l2/llama-server", *ll.argv[1:]]


def test_vs_peers_launches_and_load(tmp_path):
    args = _peers_args(tmp_path)
    # a fresh server per sampling mode: the same prompts, no prefix cache carried over
    assert vs_peers.launches(args, "vllm-bf16") == [(None, ["sg", "r2", "b1"]),
                                                    (None, ["sg-s", "r2-s", "b1-s"])]
    assert vs_peers.launches(args, "llamacpp-avx2") == [(16, ["sg", "r2"]), (1, ["b1"]),
                                                        (16, ["sg-s", "r2-s"]), (1, ["b1-s"])]
    args.llamacpp_slots = 1
    assert vs_peers.launches(args, "llamacpp")[1] == (1, ["sg-s", "r2-s", "b1-s"])
    args.llamacpp_slots = 16
    args.workloads, args.sampling = ["b1"], ["greedy"]
    assert vs_peers.launches(args, "llamacpp") == [(1, ["b1"])]
    out = tmp_path / "r.json"
    sg = vs_peers.bench_argv(args, "sg", 8002, 7, out)
    assert sg[sg.index("--tokenizer") + 1] == str(tmp_path / "hf") and "--dataset-path" in sg
    assert sg[sg.index("--num-prompts") + 1] == "64" and sg[sg.index("--seed") + 1] == "7"
    assert sg[sg.index("--temperature") + 1] == "0" and "--top-p" not in sg
    sgs = vs_peers.bench_argv(args, "sg-s", 8002, 7, out)
    assert sgs[sgs.index("--temperature") + 1] == "0.7" and sgs[sgs.index("--top-p") + 1] == "0.9"
    cut = lambda argv, flag: argv[:argv.index(flag)]
    assert cut(sgs, "--temperature") == cut(sg, "--temperature")  # the same run otherwise
    assert sgs[sgs.index("--seed"):] == sg[sg.index("--seed"):]
    # pipellm-bench sends them in every request's body, to every server alike
    ep = cli.endpoint(cli.parser().parse_args(sgs[1:]))
    assert (ep.extra_body, ep.ignore_eos) == ({"temperature": 0.7, "top_p": 0.9}, True)
    assert cli.endpoint(cli.parser().parse_args(sg[1:])).extra_body == {"temperature": 0.0}
    b1 = vs_peers.bench_argv(args, "b1", 8002, 7, out)
    assert b1[b1.index("--max-concurrency") + 1] == "1" and "--tokenizer" not in b1
    assert b1[b1.index("--num-prompts") + 1] == "16" and "--ignore-eos" in b1
    r2 = vs_peers.bench_argv(args, "r2", 8002, 7, out)
    assert r2[r2.index("--request-rate") + 1] == "2"
    warm = vs_peers.bench_argv(args, "warmup", 8002, 7, out, 8)
    assert warm[warm.index("--request-rate") + 1] == "inf" and "--max-concurrency" not in warm


def test_vs_peers_summary_and_targets(capsys):
    def row(server, wl, rep, tps, ttft=100.0, tpot=10.0, ok=True):
        return dict(server=server, workload=wl, rep=rep, ok=ok, output_throughput=tps,
                    mean_ttft_ms=ttft, mean_tpot_ms=tpot, completed=16, failed=rep)

    rows = [row("pipellm", "sg", r, t) for r, t in enumerate([300, 100, 200])]
    rows += [row("vllm-bf16", "sg", r, t) for r, t in enumerate([150, 150, 100])]
    rows += [row("llamacpp", "sg", 0, 50), row("llamacpp", "b1", 0, 0, ok=False)]
    rows += [row("pipellm", "b1", 0, 10, ttft=140.0, tpot=9.0), row("pipellm", "r2", 0, 9),
             row("vllm-bf16", "r2", 0, 9, tpot=20.0), row("vllm-fp32", "sg", 0, 120),
             row("pipellm", "sg-s", 0, 180), row("vllm-bf16", "sg-s", 0, 100),
             row("vllm-fp32", "sg-s", 0, 160), row("pipellm-avx2", "sg", 0, 150),
             row("pipellm-avx2", "sg-s", 0, 150)]
    s = peers_report.summarize(rows)
    assert list(s) == ["pipellm", "vllm-bf16", "llamacpp", "vllm-fp32", "pipellm-avx2"]
    assert s["pipellm"]["sg"]["output_throughput"] == 200
    assert (s["pipellm"]["sg"]["runs_ok"], s["pipellm"]["sg"]["failed_requests"]) == (3, 3)
    assert s["llamacpp"]["b1"] == dict(output_throughput=None, mean_ttft_ms=None,
                                       mean_tpot_ms=None, runs_ok=0, runs=1, failed_requests=0)
    # the faster vLLM row, per sampling mode
    assert (peers_report.faster_vllm(s), peers_report.faster_vllm(s, "-s")) == \
        ("vllm-bf16", "vllm-fp32")
    found = peers_report.check_targets(s, vs_peers.LLAMACPP_OF)
    checks = {(c["pipellm"], c["peer"], c["workload"], c["metric"]): c for c in found}
    # pipellm: 5 greedy (both peers), 6 sampled (+ vs its greedy run); pipellm-avx2: no
    # llamacpp-avx2 row, so vLLM's 2 greedy, 2 sampled + vs its greedy run
    assert (len(found), len(checks)) == (16, 16)
    sg = checks["pipellm", "vllm-bf16", "sg", "output_throughput"]
    assert (sg["ratio"], sg["passed"], sg["target"], sg["sampling"]) == \
        (1.333, True, ">= 1.2", "greedy")
    assert checks["pipellm", "vllm-bf16", "r2", "mean_tpot_ms"]["ratio"] == 0.5
    assert checks["pipellm", "vllm-fp32", "sg-s", "output_throughput"]["passed"] is False
    assert checks["pipellm", "vllm-fp32", "r2-s", "mean_tpot_ms"]["passed"] is None  # not run
    assert checks["pipellm", "llamacpp", "sg", "output_throughput"]["ratio"] == 4.0
    assert checks["pipellm", "llamacpp", "b1", "mean_tpot_ms"]["ratio"] is None  # it failed
    slow = checks["pipellm", "pipellm greedy", "sg-s", "output_throughput"]
    assert (slow["ratio"], slow["passed"], slow["target"]) == (0.9, False, ">= 0.95")
    assert checks["pipellm-avx2", "pipellm-avx2 greedy", "sg-s", "output_throughput"]["passed"]
    assert not any(c["peer"] == "llamacpp" for c in found if c["pipellm"] == "pipellm-avx2")
    peers_report.print_report(s, found, {"pipellm": "pipellm up --port PORT"})
    text = capsys.readouterr().out
    assert "met" in text and "MISSED" in text and "n/a" in text
    assert "4 met, 4 missed, 8 n/a of 16" in text
    assert json.loads(json.dumps(s)) == s


def test_llamacpp_finds_a_server_before_building(tmp_path, monkeypatch):
    binary = tmp_path / "cache" / llamacpp.BINARY
    monkeypatch.delenv(llamacpp.ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert llamacpp.find_server(None, tmp_path / "cache") is None
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert llamacpp.ensure_server(None, tmp_path / "cache", build=False) == binary
    mine = tmp_path / "mine"
    mine.write_text("#!/bin/sh\n")
    mine.chmod(0o755)
    monkeypatch.setenv(llamacpp.ENV_VAR, str(mine))
    assert llamacpp.find_server(None, tmp_path / "cache") == mine
    with pytest.raises(FileNotFoundError):
        llamacpp.find_server(str(tmp_path / "nothing"), tmp_path / "cache")
    monkeypatch.delenv(llamacpp.ENV_VAR)
    with pytest.raises(FileNotFoundError):
        llamacpp.ensure_server(None, tmp_path / "none", build=False)
    # a build configured with other flags (native with AMX) is not used
    cmake_cache = binary.parents[1] / "CMakeCache.txt"
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake_cache.write_text(f"//x\nGGML_NATIVE:BOOL=ON\nCMAKE_C_FLAGS:STRING={flags}\n"
                           f"CMAKE_CXX_FLAGS:STRING={flags}\n")
    assert llamacpp.find_server(None, tmp_path / "cache") == binary
    cmake_cache.write_text("GGML_NATIVE:BOOL=ON\nCMAKE_C_FLAGS:STRING=\n")
    assert llamacpp.stale(tmp_path / "cache") and not llamacpp.find_server(None, tmp_path / "cache")
    # the AVX2 build: its own directory and variable, never PATH's llama-server
    avx2 = tmp_path / "cache" / "build-avx2" / "bin" / "llama-server"
    assert llamacpp.binary(tmp_path / "cache", "avx2") == avx2
    assert llamacpp.env_var("avx2") == "LLAMA_SERVER_AVX2"
    assert "-DGGML_AVX512=OFF" in llamacpp.VARIANTS["avx2"]
    monkeypatch.setenv("PATH", str(mine.parent))
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "llama-server").chmod(0o755)
    assert llamacpp.find_server(None, tmp_path / "cache", "avx2") is None
    avx2.parent.mkdir(parents=True)
    avx2.write_text("#!/bin/sh\n")
    avx2.chmod(0o755)
    assert llamacpp.ensure_server(None, tmp_path / "cache", build=False, variant="avx2") == avx2


def test_vllm_threads_note_reads_its_log(tmp_path):
    log = tmp_path / "vllm-bf16-rep0.log"
    assert vllm_cpu.threads_note(log) is None
    log.write_text("x\tlocal_rank=0, core ids=[0, 1]\nReducing Torch threads from 2 to 2\n")
    assert vllm_cpu.threads_note(log) == "model on cores [0, 1] with 2 torch thread(s)"


def test_server_stops_its_whole_process_group(tmp_path):
    port = servers.free_port()
    script = (f"sleep 300 & echo $! > {tmp_path}/child.pid; "
              f"exec {sys.executable} -m http.server {port} --bind 127.0.0.1")
    srv = servers.Server("http", ["sh", "-c", script], f"http://127.0.0.1:{port}/",
                         tmp_path / "http.log")
    with servers.running(srv, timeout_s=30) as startup_s:
        assert startup_s < 30 and servers.http_ok(srv.ready_url)
    child = int((tmp_path / "child.pid").read_text())
    assert not servers.http_ok(srv.ready_url)

    def gone() -> bool:  # exited, or a zombie left for init to reap
        try:
            return "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10  # the signal is sent; the child may not have run yet
    while not gone():
        assert time.monotonic() < deadline, "the server's child outlived it"
        time.sleep(0.05)


def test_server_that_exits_early_raises_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    srv = servers.Server("bad", argv, "http://127.0.0.1:9/", tmp_path / "bad.log")
    with pytest.raises(servers.ServerError, match="no model here"), servers.running(srv, 30):
        pass
    assert srv.proc is None


def test_gpu_report_fits_the_simulator_to_decode_timings(tmp_path, capsys):
    """The GPU suite's report on step files shaped like bench/decode_step.py's JSON, made from a
    known cost model: the fit recovers it (the INT4 step listed but not fitted); missing steps
    read as not measured."""
    from bench import gpu_report
    from pipellm.services.compute.sim.cost import CostModel

    truth = CostModel("h100", "llama-3-8b", eff_bw=0.8, overhead_s=0.5e-3)
    for name, ctx in (("decode1k", 1024), ("decode4k", 4096)):
        batches = {str(b): {"graph_ms": 1e3 * truth.decode(b, ctx).time_s, "graph_pct_bound": 81.0}
                   for b in (1, 16, 64, 256)}
        (tmp_path / f"{name}.json").write_text(json.dumps({"context": ctx, "batches": batches}))
    int4 = {"1": {"graph_ms": 1.5, "graph_pct_bound": 70.0}}  # W4A16: listed, not fitted
    (tmp_path / "decode_int4.json").write_text(json.dumps({"context": 1024, "batches": int4}))
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3, 81559 MiB, 580.1")
    (tmp_path / "lengths.json").write_text(json.dumps(
        {"step_ms_off": 10.0, "step_ms_on": 10.2, "slowdown": 0.02, "hook_share": 0.012}))
    gpu_report.main([str(tmp_path)])
    text = capsys.readouterr().out
    out = last_json(text)
    assert out["fit"]["eff_bw"] == pytest.approx(0.8, rel=1e-3)
    assert out["fit"]["overhead_ms"] == pytest.approx(0.5, rel=1e-2)
    assert out["verdicts"] == {"decode_graph_pct_bound": "met", "offline_ratio": "not measured",
                               "host_share_of_step": "not measured",
                               "length_hook_share": "NOT met",  # 1.2% > 1%
                               "vs_vllm_throughput": "not measured",
                               "vs_vllm_tpot": "not measured"}
    assert "10.2 ms with it" in text
    assert "decode_int4 batch 1: eager None ms, graph 1.5 ms" in text
    assert out["steps"]["decode_int4"]


def test_gpu_suite_script_parses():
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "wheels" in usage.stdout


def test_length_step_cost_runs_both_engines(demo_model_dir, capsys):
    """bench/length_step_cost.py on the tiny model: both engines step, requests finish and
    are learned during the timed steps, and the hook predicts at its checkpoints."""
    import json

    from bench import length_step_cost

    out = length_step_cost.main(["--model", str(demo_model_dir), "--batch", "4", "--steps",
                                 "40", "--rounds", "2", "--every", "8"])
    assert out["finished"] > 0 and out["predictions"] > 0 and out["worker"] is True
    assert out["step_ms_off"] > 0 and out["hook_ms"] > 0  # syncs: once a second, maybe none
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out


def test_decode_host_times_the_kernels_calls_of_decode_steps(demo_model_dir, capsys):
    """bench/decode_host.py on the tiny model: the C++ module's calls of the decode steps are
    timed (attention, RoPE, norms), less than the whole step; the module is given back. The
    demo model's float projections are not block GEMMs: no fused variant."""
    from bench import decode_host
    from pipellm.kernels import cpu

    out = decode_host.main(["--model", str(demo_model_dir), "--prompt", "16", "--tokens", "6",
                            "--requests", "1", "--rounds", "1"])
    assert last_json(capsys.readouterr().out) == out
    loop = out["loop"]
    assert 0 < loop["kernel_ms"] < loop["step_ms"] and loop["calls"] > 0
    assert {"decode_attention", "rope_kv_write"} <= set(loop["kernels_ms"])
    assert "fused" not in out and "speedup" not in out
    assert not isinstance(cpu.extension(), decode_host.TimedModule)


def test_speculative_bench_parts(tmp_path, capsys):
    """bench/speculative.py without servers: its server commands, prompt sets, /metrics
    parsing, and the summary's ratios, output equality and targets on made-up runs."""
    from bench import speculative

    args = speculative.parse_args(["--results-dir", str(tmp_path)])
    assert (args.servers, args.levels, args.rounds) == (list(speculative.SERVERS), [1, 16], 3)
    quick = speculative.parse_args(["--quick", "--servers", "pipellm,pipellm-ngram"])
    assert (quick.levels, quick.b1_requests, quick.requests, quick.max_tokens) == ([1, 4], 2, 8, 64)
    args.gguf, args.hf_dir, args.llamacpp_bin = tmp_path / "m.gguf", tmp_path / "hf", "/l/ls"
    spec = speculative.make(args, "pipellm-ngram", 8001, tmp_path / "x.log")
    assert spec.name == "pipellm-ngram" and spec.argv[-2] == "--speculative-config"
    assert json.loads(spec.argv[-1])["num_speculative_tokens"] == 6
    assert "--speculative-config" not in speculative.make(args, "pipellm", 8001, tmp_path).argv
    ll = speculative.make(args, "llamacpp-ngram", 8002, tmp_path / "y.log", slots=1)
    assert ll.argv[ll.argv.index("-np") + 1] == "1" and "ngram-simple" in ll.argv
    assert speculative.launches(args, "llamacpp") == [(1, [1]), (16, [16])]
    assert speculative.launches(args, "pipellm-ngram") == [(None, [1, 16])]

    pairs = [(f"what is the answer to question {i}", " ".join(["word"] * (90 + 10 * i)))
             for i in range(30)]
    prompts = speculative.pick_prompts(pairs, lambda t: len(t.split()), quick)
    g = prompts["grounded"]
    assert [len(g[k]) for k in ("warmup", 1, 4)] == [2, 2, 8]
    assert len(set(g[1]) | set(g[4])) == 10 and all("word" in p for p in g[1])  # 100..300

    page = ("# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            "vllm:spec_decode_num_draft_tokens_total 40.0\n"
            "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            "vllm:spec_decode_num_accepted_tokens_total 30.0\n")
    assert speculative.spec_counts(page) == (40.0, 30.0)

    def row(server, wl, conc, rep, tok_s, texts):
        recs = [dict(text=t, error=None) for t in texts]
        return dict(server=server, workload=wl, conc=conc, rep=rep, ok=True, tok_s=tok_s,
                    tpot_ms=1000 / tok_s, ttft_ms=50.0, accept_rate=None, errors=0, short=0,
                    records=recs)

    rows = []
    for rep in range(3):
        rows += [row("pipellm", "grounded", 1, rep, 40.0, ["a", "b"]),
                 row("pipellm-ngram", "grounded", 1, rep, 70.0 + rep, ["a", "b"]),
                 row("pipellm", "sharegpt", 1, rep, 40.0, ["c", "d"]),
                 row("pipellm-ngram", "sharegpt", 1, rep, 39.0, ["c", "x"]),
                 row("pipellm", "sharegpt", 16, rep, 200.0, ["e"]),
                 row("pipellm-ngram", "sharegpt", 16, rep, 180.0, ["e"])]
    s = speculative.summarize(rows)
    assert s["servers"]["pipellm-ngram"]["grounded_c1"]["tok_s"] == 71.0
    r = s["ratios"]["pipellm-ngram/pipellm"]
    assert r["grounded_c1"]["tok_s"] == 1.775 and r["sharegpt_c16"]["tok_s"] == 0.9
    assert s["same_output"]["pipellm-ngram/pipellm"] == {"grounded_c1": 1.0, "sharegpt_c1": 0.5,
                                                         "sharegpt_c16": 1.0}
    checks = speculative.check_targets(s, [1, 16])
    assert [c["passed"] for c in checks] == [True, False] and checks[1]["ratio"] == 0.9
    speculative.print_report(s, checks, {})
    assert "PASS" in capsys.readouterr().out
    assert [c["passed"] for c in speculative.check_targets(speculative.summarize([]), [1])] \
        == [None, None]


def test_spec_sim_prints_the_best_k_per_batch(capsys):
    from bench import spec_sim

    spec_sim.main([])
    out = last_json(capsys.readouterr().out)["best"]
    draft, ngram = out["draft llama-3.2-1b"], out["n-gram"]
    assert draft["b1 a0.9"]["speedup"] > draft["b1 a0.5"]["speedup"] > 1  # memory-bound
    assert draft["b128 a0.5"]["speedup"] < 1  # compute-bound: the draft's rows cost
    assert ngram["b1 a0.7"]["speedup"] > draft["b1 a0.7"]["speedup"]  # no draft steps


def test_host_step_times_a_decode_step_with_each_heap_setting():
    import gc

    from bench.host_step import one_run
    from pipellm.shared.config import ServiceConfig

    out = one_run("default", 8, 5)
    assert out["running"] == 8 and out["steps"] == 5 and out["mean"] > 0
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        one_run("settled", 8, 5)  # measured as compute runs: start-up's heap frozen, and
        assert gc.get_freeze_count() > frozen  # young collections every so many allocations
        assert gc.get_threshold()[0] == ServiceConfig.gc_young_threshold
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_cpu_attention_quick(capsys):
    """bench/cpu_attention.py: every path this CPU runs, timed, its speed against the generic
    code's, in the JSON line; fp16 caches under float32 queries against float32 ones; another
    model's heads."""
    from bench import cpu_attention
    from pipellm.kernels.cpu import isa

    out = cpu_attention.main(["--quick"])
    assert last_json(capsys.readouterr().out) == out
    paths = ["generic"] + [v for v in cpu_attention.VARIANTS if v in isa.cpu_levels()]
    assert out["paths"] == paths and len(out["rows"]) == 1
    row = out["rows"][0]
    assert set(row["ms"]) == set(paths) and all(v > 0 for v in row["ms"].values())
    assert row["speed"]["generic"] == 1.0 and row["vs_same"] is None
    out = cpu_attention.main(["--quick", "--dtype", "float32", "--cache-dtype", "float16"])
    assert out["cache_dtype"] == "float16" and out["rows"][0]["vs_same"] > 0
    out = cpu_attention.main(["--quick", "--heads", "4,2,96"])
    assert last_json(capsys.readouterr().out) == out and out["heads"] == [4, 2, 96]
    assert out["code"] == {p: p for p in paths}  # 96: a multiple of 8 and of 16


def test_cpu_prefill_attention_bench_small(capsys):
    """bench/cpu_prefill_attention.py on one small batch: every path this CPU runs timed (AMX
    tiles, and a pooling forward's coarse P on the tiles or as bf16 products, where the CPU
    has them), the ratios and one JSON line."""
    from pipellm.kernels.cpu import extension, isa

    ext = extension()
    if ext is None or not ext.block_gemm_isa():
        pytest.skip(f"the C++ kernels do not run here ({isa.describe()})")
    from bench import cpu_prefill_attention

    out = cpu_prefill_attention.main(["--tokens", "300", "--batches", "1", "--threads", "1",
                                      "--reps", "2"])
    names = set(out["ms"][1])
    assert {"gemm", "avx2", "sdpa"} <= names and sum(out["batches"][0]) <= 300
    coarse = "amx_coarse_p" if ext.prefill_attention_amx_ready() else \
        "avx512_bf16" if "avx512_bf16" in isa.cpu_flags() else None
    if coarse:
        assert coarse in names
    assert set(out["gemm_over_kernel"][1]) == names - {"gemm", "sdpa"}
    assert min(out["gemm_over_kernel"][1].values()) > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bench"] == \
        "cpu_prefill_attention"


def test_decode_step_quick_builds_the_served_projections(capsys):
    """bench/decode_step.py --quick (the tiny model, interpreted, eager only), 16-bit and
    --quantization int4: finite logits at both batch sizes; with int4 the projections are the
    server's Int4Linear, and the bytes the bound counts are the packed layout's."""
    from bench import decode_step
    from pipellm.services.compute.model.linear.int4 import Int4Linear

    built, real = [], decode_step.build_model
    decode_step.build_model = lambda *a, **kw: built.append(real(*a, **kw)) or built[-1]
    try:
        outs = {}
        for method in ("none", "int4"):
            decode_step.main(["--quick", "--quantization", method])
            outs[method] = last_json(capsys.readouterr().out)
    finally:
        decode_step.build_model = real
    for method, out in outs.items():
        assert out["quantization"] == method and set(out["batches"]) == {"1", "4"}
        assert all(b["eager_ms"] > 0 and b["logits_finite"] for b in out["batches"].values())
    dense, int4 = built
    assert not isinstance(dense.layers[0].down, Int4Linear)
    assert isinstance(int4.layers[0].down, Int4Linear)
    assert int4.weight_bytes() < 0.75 * dense.weight_bytes()


def test_codec_bench_times_both_encodings_of_the_same_batch(capsys):
    out = codec.main(["--deltas", "8", "--rounds", "1", "--reps", "5"])
    assert last_json(capsys.readouterr().out) == out
    now, base = out["per_delta"]["fields at defaults left out"], \
        out["per_delta"]["every field (baseline)"]
    assert 0 < now["bytes"] < base["bytes"] and now["decode_us"] > 0


def test_health_check_bench_times_both_reads(capsys):
    out = health_check.main(["--keys", "0,300", "--reps", "2"])
    assert last_json(capsys.readouterr().out) == out
    assert [r["request_keys"] for r in out["rows"]] == [0, 300]
    assert all(r["set_ms"] > 0 and r["scan_ms"] > 0 for r in out["rows"])


def test_serve_host_counts_each_process_cpu_per_token(capsys):
    """Both variants served on the simulated backend, every service's CPU counted."""
    out = serve_host.main(["--prompts", "16", "--rounds", "1"])
    assert last_json(capsys.readouterr().out) == out
    for variant in ("now", "baseline"):
        per = out["variants"][variant]["us_per_token"]
        assert set(per) == {"gateway", "tokenizer", "compute", "detokenizer", "client"}
        assert min(per["gateway"], per["compute"], per["detokenizer"], per["client"]) > 0


def test_gateway_receive_times_both_loops(capsys):
    """Both receive loops take every message from a sender process, paced and in a burst."""
    out = gateway_receive.main(["--messages", "200", "--gap-ms", "0.5", "--rounds", "1"])
    assert last_json(capsys.readouterr().out) == out
    for mode in ("paced", "burst"):
        assert out[mode]["now_us"] > 0 and out[mode]["baseline_us"] > 0


def test_pooling_benches_send_no_text_twice():
    """bench/pooling.py and bench/rerank.py give every workload, warm-up and question texts of
    their own (a server's prefix cache must not serve any of them from memory)."""
    from bench import pooling, rerank

    texts = pooling.distinct_texts(1000, 200)
    sent = [t for ts in texts.workloads.values() for t in ts] + texts.warm_up + texts.questions
    assert [len(t) for t in texts.workloads.values()] == [1000, 1000]
    assert len(texts.warm_up) == pooling.WARM_UP and len(texts.questions) == 200
    assert len(set(sent)) == len(sent) and max(map(len, texts.questions)) <= pooling.QUERY_CHARS
    with pytest.raises(SystemExit, match="distinct texts"):
        pooling.distinct_texts(2000, 200)
    bodies = rerank.bodies(8, 32, 1000)
    docs = [d for b in bodies for d in b["documents"]]
    assert len(bodies) == 9 and {len(b["documents"]) for b in bodies} == {32}
    assert len(set(docs)) == len(docs) and len({b["query"] for b in bodies}) == 9
    assert rerank.agreement([[0.1, 0.9, 0.5], [0.7, 0.2, 0.1]],
                            [[0.3, 1.9, 1.1], [1.5, 0.5, 0.3]]) == {"pearson": 1.0,
                                                                   "same_best": 1.0}
    assert rerank.agreement([[0.9, 0.1]], [[0.1, 0.9]]) == {"pearson": -1.0, "same_best": 0.0}
