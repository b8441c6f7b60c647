"""The load generator's CLI against the real stack (`pipellm up`, demo model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipellm.loadgen import cli
from tests.stack import Stack

MODEL = "demo-llama"
SUMMARY_KEYS = {
    "date", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
}
ARRAY_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
              "errors"}


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    # One torch thread in compute: on a small shared CPU, torch's default (one thread per core)
    # oversubscribes it when anything else runs, and decode steps get 10-100x slower.
    s = Stack(demo_model_dir, "--served-model-name", MODEL, "--threads", "1").start()
    yield s
    s.stop()


def _bench(stack: Stack, tmp_path: Path, *extra: str) -> dict:
    argv = ["--base-url", stack.url, "--dataset-name", "random", "--random-input-len", "16",
            "--random-output-len", "8", "--ignore-eos", "--disable-tqdm", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "r.json", *extra]
    assert cli.main(argv) == 0
    return json.loads((tmp_path / "r.json").read_text())


@pytest.mark.parametrize("extra", [
    ("--num-prompts", "12", "--goodput", "ttft:60000", "e2el:60000"),
    ("--num-prompts", "12", "--request-rate", "20", "--max-concurrency", "4"),
    ("--num-prompts", "4", "--endpoint", "/v1/chat/completions", "--mode", "throughput"),
], ids=["rate-inf", "rate-20-concurrency-4", "chat-throughput"])
def test_run_against_the_stack(stack, tmp_path, capsys, extra):
    r = _bench(stack, tmp_path, *extra)
    n = int(extra[1])
    assert SUMMARY_KEYS | ARRAY_KEYS <= set(r)
    assert r["model_id"] == MODEL and r["num_prompts"] == n
    assert (r["completed"], r["failed"]) == (n, 0) and r["errors"] == [""] * n
    assert r["output_lens"] == [8] * n and r["total_output_tokens"] == 8 * n
    assert r["input_lens"] == [16] * n  # calibrated prompts hit the target exactly
    assert all(len(itl) == 7 for itl in r["itls"])  # one chunk per token on this server
    assert 0 < r["mean_ttft_ms"] < r["mean_e2el_ms"] and r["mean_tpot_ms"] > 0
    assert r["request_throughput"] == pytest.approx(n / r["duration"])
    assert 0 < r["max_output_tokens_per_s"] <= 8 * n
    if "--max-concurrency" in extra:
        assert r["max_concurrency"] == 4 and r["max_concurrent_requests"] <= 4
        assert r["request_rate"] == 20.0 and r["request_goodput"] is None
    if "--goodput" in extra:
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and f"Successful requests:{' ' * 21}{n}" in out


def test_tiny_sweep_reports_qps_at_slo(stack, tmp_path, capsys):
    r = _bench(stack, tmp_path, "--num-prompts", "6", "--sweep", "--sweep-start-rate", "8",
               "--sweep-probes", "2", "--sweep-slo", "ttft:60000", "tpot:10000")
    assert r["qps_at_slo"] == 16.0  # both probes meet so lenient an SLO
    assert [p["request_rate"] for p in r["probes"]] == [8.0, 16.0]
    assert all(p["completed"] == 6 and p["meets_slo"] for p in r["probes"])
    assert r["slo"] == {"percentile": 99.0, "ttft_ms": 60000.0, "tpot_ms": 10000.0}
    assert "qps_at_slo: 16.000 req/s" in capsys.readouterr().out
