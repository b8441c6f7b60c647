"""The simulator-side benchmarks run end to end on small inputs and end with their JSON line."""

from __future__ import annotations

import json

from bench import ablation, length_predictor

ROW_KEYS = {"name", "model", "workload", "qps_at_slo", "output_throughput", "p99_ttft_ms",
            "p99_tpot_ms", "preemptions"}


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_ablation_quick(capsys):
    ablation.main(["--quick", "--workloads", "sharegpt"])
    rows = last_json(capsys.readouterr().out)["rows"]
    assert [r["name"] for r in rows] == [v.name for v in ablation.VARIANTS]
    assert all(ROW_KEYS <= set(r) and r["simulated"] is True for r in rows)
    assert all(isinstance(r["preemptions_at_paged_qps"], int) for r in rows)
    by = {r["name"]: r for r in rows}
    # merged steps beat static batching; INT8 KV doubles the slots
    assert by["merged steps, max-length KV"]["max_output_throughput"] > \
        by["static batching, max-length KV"]["max_output_throughput"]
    int8, fp16 = by["merged, predicted KV (learned), INT8 KV"], \
        by["merged, predicted KV (learned predictor)"]
    assert int8["kv_capacity"] == 2 * fp16["kv_capacity"]


def test_length_predictor_bench_small(capsys):
    length_predictor.main(["--limit", "120"])
    methods = last_json(capsys.readouterr().out)["methods"]
    assert set(methods) == {"max_tokens", "global_p90", "predictor", "oracle"}
    assert methods["oracle"] == {"mae": 0.0, "outgrow_rate": 0.0, "reserved_over_used": 1.0}
    assert methods["max_tokens"]["reserved_over_used"] > methods["predictor"][
        "reserved_over_used"] > 1.0
