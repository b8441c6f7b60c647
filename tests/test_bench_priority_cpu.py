"""bench/priority_cpu.py's parts that need neither a server nor the SmolLM2 GGUF: its argument
parsing, server and client command lines, and the summary's ratios and targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import priority_cpu
from pipellm.loadgen import cli


def _result(inter_p99: float, tok_s: float, mean_e2e: float, p50_e2e: float) -> dict:
    """A pipellm-bench result with a priority mix, as much of it as row_of reads."""
    return dict(completed=100, failed=0, duration=60.0, output_throughput=tok_s,
                mean_e2el_ms=mean_e2e, median_e2el_ms=p50_e2e, p99_e2el_ms=3 * mean_e2e,
                classes=dict(interactive=dict(completed=10, median_ttft_ms=inter_p99 / 2,
                                              p99_ttft_ms=inter_p99),
                             batch=dict(completed=90, median_ttft_ms=900.0,
                                        p99_ttft_ms=4000.0)))


def test_args_defaults_and_quick(tmp_path):
    args = priority_cpu.parse_args(["--results-dir", str(tmp_path)])
    assert args.servers == ["pipellm-fcfs", "pipellm-priority", "vllm-fcfs", "vllm-priority",
                            "pipellm-predicted"]
    assert (args.num_prompts, args.interactive_fraction, args.max_num_seqs) == (160, 0.1, 16)
    quick = priority_cpu.parse_args(["--quick", "--servers", "pipellm-fcfs,vllm-priority"])
    assert quick.num_prompts == 40 and quick.servers == ["pipellm-fcfs", "vllm-priority"]
    assert quick.results_dir.parent.name == "priority"
    with pytest.raises(SystemExit):
        priority_cpu.parse_args(["--servers", "sglang"])
    with pytest.raises(SystemExit):
        priority_cpu.parse_args(["--interactive-fraction", "0"])


def test_server_and_bench_command_lines(tmp_path):
    args = priority_cpu.parse_args(["--results-dir", str(tmp_path), "--max-queue-delay-ms",
                                    "5000"])
    args.gguf, args.hf_dir = Path("/m/smol.gguf"), Path("/m/smol-hf")
    pred = priority_cpu.make_server(args, "pipellm-predicted", 8001, tmp_path / "p.log")
    assert pred.argv[1:6] == ["up", "--model", "/m/smol.gguf", "--port", "8001"]
    assert " --scheduling-policy predicted --max-num-seqs 16 --max-queue-delay-ms 5000" in \
        " " + " ".join(pred.argv)
    vllm = priority_cpu.make_server(args, "vllm-priority", 8002, tmp_path / "v.log")
    assert vllm.argv[1:3] == ["serve", "/m/smol-hf"] and "bfloat16" in vllm.argv
    assert "--scheduling-policy priority --max-num-seqs 16" in " ".join(vllm.argv)
    assert vllm.env["VLLM_TARGET_DEVICE"] == "cpu" and "--max-queue-delay-ms" not in vllm.argv
    assert priority_cpu.command(vllm, 8002).startswith("VLLM_TARGET_DEVICE=cpu ")
    out = tmp_path / "r.json"
    argvs = {name: priority_cpu.bench_argv(args, name, 8001, out)
             for name in priority_cpu.SERVERS}
    for name, argv in argvs.items():  # the client takes them; the mix only under priority
        parsed = cli.parser().parse_args(argv[1:])
        assert parsed.batch_priority == (1 if name.endswith("priority") else 0)
        assert (parsed.interactive_fraction, parsed.num_prompts, parsed.seed) == (0.1, 160, 0)
        assert parsed.interactive_priority == 0 and parsed.ignore_eos
        assert (parsed.random_range_ratio, parsed.request_rate) == (0.9, 4.0)
    same = {tuple(a for a in argv if a not in ("0", "1")) for argv in argvs.values()}
    assert len(same) == 1  # the same traffic everywhere but the priorities
    cli.parser().parse_args(priority_cpu.warmup_argv(args, 8001, out)[1:])


def test_summary_ratios_and_targets():
    rows = [priority_cpu.row_of(n, _result(*fig), 5.0) for n, fig in (
        ("pipellm-fcfs", (6000.0, 200.0, 10000.0, 9000.0)),
        ("pipellm-priority", (300.0, 190.0, 10100.0, 9100.0)),
        ("pipellm-predicted", (1000.0, 205.0, 6000.0, 4500.0)),
        ("vllm-fcfs", (5000.0, 220.0, 9000.0, 8000.0)),
        ("vllm-priority", (1500.0, 180.0, 9000.0, 8000.0)))]
    rows.append(priority_cpu.row_of("vllm-fcfs", None))  # a failed start counts for nothing
    assert rows[0]["interactive_p99_ttft_ms"] == 6000.0 and rows[0]["startup_s"] == 5.0
    s = priority_cpu.summarize(rows[:5])
    assert s["ratios"]["pipellm-priority"] == dict(
        interactive_p99_ttft_x_lower=20.0, output_tok_s_ratio=0.95, mean_e2e_cut=-0.01,
        p50_e2e_cut=-0.011)
    assert s["ratios"]["pipellm-predicted"]["mean_e2e_cut"] == 0.4
    assert s["ratios"]["pipellm-predicted"]["p50_e2e_cut"] == 0.5
    assert s["ratios"]["vllm-priority"]["interactive_p99_ttft_x_lower"] == 3.3
    assert s["pipellm_vs_vllm_priority_p99_ttft_x"] == 5.0
    met = {t["what"]: t["met"] for t in s["targets"]}
    assert met["pipellm-priority: interactive p99 TTFT x lower than fcfs"] is True
    assert met["vllm-priority: interactive p99 TTFT x lower than fcfs"] is False
    assert met["vllm-priority: output tok/s / fcfs's"] is False  # 180 / 220
    assert met["interactive p99 TTFT: vllm-priority's / pipellm-priority's"] is True
    assert (s["met"], s["of"]) == (5, 7)
    partial = priority_cpu.summarize(rows[:2])  # no vLLM, no predicted: not measured
    assert partial["pipellm_vs_vllm_priority_p99_ttft_x"] is None
    assert sum(t["met"] is None for t in partial["targets"]) == 5


def test_report_prints_every_row(capsys):
    rows = [priority_cpu.row_of("pipellm-fcfs", _result(6000.0, 200.0, 1e4, 9e3)),
            priority_cpu.row_of("pipellm-priority", None)]
    priority_cpu.print_report(rows, priority_cpu.summarize(rows), {"pipellm-fcfs": "pipellm up"})
    out = capsys.readouterr().out
    assert "| pipellm-fcfs | 3000.0 | 6000.0 | 900.0 | 200.0 |" in out
    assert "| pipellm-priority | - |" in out and "not measured" in out
