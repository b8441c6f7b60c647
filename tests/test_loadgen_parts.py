"""Load generator, pure helpers: the QPS search, prompt synthesis, reports, progress, plots."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
import sys

import pytest

from pipellm.loadgen import plots, report, sweep
from pipellm.loadgen.datasets import WorkItem
from pipellm.loadgen.metrics import RequestRecord, class_summary, per_request, summarize
from pipellm.loadgen.progress import Progress
from pipellm.loadgen.prompts import ANCHOR, PromptModel, fill_prompts, local_model
from pipellm.loadgen.workload import priority_mix
from tests.hf_models import demo_tokenizer


def _fake_probe(capacity: float, calls: list[float]):
    """A server that meets the SLO up to `capacity` req/s."""
    def probe(rate: float) -> dict:
        calls.append(rate)
        ok = rate <= capacity
        return {"completed": 10, "failed": 0, "p99_ttft_ms": 100 if ok else 5000,
                "p99_tpot_ms": 10.0, "request_throughput": min(rate, capacity),
                "ttfts": [0.1] * 10}
    return probe


def test_sweep_doubles_then_bisects():
    calls: list[float] = []
    found = sweep.search(_fake_probe(5.3, calls), sweep.SweepConfig(max_probes=10))
    assert calls == [1, 2, 4, 8, 6, 5, 5.5, 5.25]  # stops once within 5% (5.25 .. 5.5)
    assert found["qps_at_slo"] == 5.25
    assert [p["meets_slo"] for p in found["probes"]] == [True] * 3 + [False] * 2 + [
        True, False, True]
    assert "ttfts" not in found["probes"][0] and found["probes"][0]["request_rate"] == 1
    assert found["slo"] == {"percentile": 99.0, "ttft_ms": 3000.0, "tpot_ms": 50.0}


def test_sweep_probe_budget_and_first_probe_failing():
    calls: list[float] = []
    found = sweep.search(_fake_probe(0.3, calls), sweep.SweepConfig(start_rate=2, max_probes=3))
    assert calls == [2, 1, 0.5] and found["qps_at_slo"] == 0.0
    calls.clear()
    found = sweep.search(_fake_probe(100, calls), sweep.SweepConfig(start_rate=2, max_probes=2))
    assert calls == [2, 4] and found["qps_at_slo"] == 4


def test_short_run_note():
    found = {"qps_at_slo": 100.0, "slo": {"percentile": 99.0, "ttft_ms": 3000.0}}
    assert "within 0.4 s" in sweep.short_run_note(found, 40)
    assert sweep.short_run_note(found, 1200) is None  # 12 s of arrivals >= 4 x 3 s
    assert sweep.short_run_note({**found, "qps_at_slo": 0.0}, 40) is None
    assert sweep.short_run_note({**found, "slo": {"tpot_ms": 50.0}}, 40) is None


def test_sweep_meets_needs_every_slo_and_no_failures():
    cfg = sweep.SweepConfig(slos={"ttft": 100, "e2el": 500}, percentile=90)
    ok = {"completed": 3, "failed": 0, "p90_ttft_ms": 100, "p90_e2el_ms": 499}
    assert sweep.meets(ok, cfg)
    assert not sweep.meets({**ok, "p90_e2el_ms": 501}, cfg)
    assert not sweep.meets({**ok, "failed": 1}, cfg)
    assert not sweep.meets({**ok, "completed": 0}, cfg)


def test_prompt_model_with_the_demo_tokenizer_is_exact():
    tok = demo_tokenizer()
    count = lambda text: len(tok.encode(text).ids)  # noqa: E731
    pm = local_model(count)
    assert pm.anchor_tokens == count(ANCHOR) and min(pm.costs.values()) == 1
    items = [WorkItem(None, n, 1) for n in (2, 5, 17, 120, 900)] + [WorkItem("kept", 9, 1)]
    filled = fill_prompts(items, pm, seed=4)
    assert [count(w.prompt) for w in filled[:-1]] == [2, 5, 17, 120, 900]
    assert filled[-1] is items[-1]
    assert filled == fill_prompts(items, pm, seed=4) != fill_prompts(items, pm, seed=5)


def test_prompt_model_without_a_cost_one_word_gets_close():
    pm = PromptModel(2, {"aa": 2, "bbb": 3})
    text = pm.text(8, random.Random(0))  # 6 tokens of words from costs {2, 3}: exact
    assert pm.length(text) == 8
    assert pm.length(pm.text(3, random.Random(0))) == 2  # 1 left, no word fits


def _result() -> dict:
    recs = [RequestRecord(10, 4, True, "", 0.0, 0.1, [0.02, 0.03, 0.05], 0.2, 4),
            RequestRecord(20, 4, False, "HTTP 500")]
    return {"model_id": "m", "request_rate": "inf", "max_concurrency": 4,
            **summarize(recs, 2.0, [50, 99], slos={"ttft": 1000}), **per_request(recs)}


def test_failures_name_the_commonest_errors():
    errors = ["", "HTTP 503: not ready", "HTTP 400: bad", "HTTP 503: not ready", "a", "b", ""]
    assert report.failures(errors, most=2).splitlines() == [
        "5 of 7 requests failed:", "  2 x HTTP 503: not ready", "  1 x HTTP 400: bad",
        "  ... and 2 other errors"]
    assert report.failures(["", ""]) == ""


def test_table_has_vllm_lines():
    text = report.table(_result(), ["ttft", "tpot", "itl", "e2el"], [50, 99])
    for line in ("Successful requests:                     1",
                 "Failed requests:                         1",
                 "Maximum request concurrency:             4",
                 "Request goodput (req/s):                 0.50",
                 "Peak output token throughput (tok/s):    4.00",
                 "P99 TTFT (ms):                           100.00",
                 "Mean TPOT (ms):                          33.33",
                 "P50 ITL (ms):                            30.00"):
        assert line in text
    assert "Request rate configured" not in text


def test_result_path_and_save(tmp_path):
    p = report.result_path("openai", 4.0, 8, "org/model", "20240101-000000", None,
                           str(tmp_path / "d"))
    assert p == tmp_path / "d" / "openai-4.0qps-concurrency8-model-20240101-000000.json"
    assert report.result_path("x", "inf", None, "m", "s", "given.json", None).name == "given.json"
    report.save({"a": math.inf, "b": [1.0, math.nan], "c": {"d": 2}}, p)
    assert json.loads(p.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


def test_progress_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = Progress(20, "requests", stream=out)
    for i in range(20):
        bar.update(ok=i % 5 != 0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("requests [" + "#" * 30 + "] 20/20")
    assert "failed 4" in lines[-1]
    quiet = io.StringIO()
    Progress(3, stream=quiet, enabled=False).update(True)
    assert quiet.getvalue() == ""


def test_plots_write_pngs_or_say_why(tmp_path, capsys):
    r = _result()
    found = {"qps_at_slo": 2.0, "slo": {"percentile": 99.0, "ttft_ms": 3000.0},
             "probes": [{"request_rate": 1.0, "request_throughput": 1.0, "output_throughput": 9,
                         "p99_ttft_ms": 50.0, "p99_tpot_ms": 5.0, "meets_slo": True},
                        {"request_rate": 2.0, "request_throughput": 1.9, "output_throughput": 17,
                         "p99_ttft_ms": 80.0, "p99_tpot_ms": 6.0, "meets_slo": True}]}
    assert plots.latency_samples_ms(r) == {"TTFT": pytest.approx([100.0]),
                                           "TPOT": pytest.approx([100 / 3]),
                                           "ITL": pytest.approx([20.0, 30.0, 50.0]),
                                           "E2EL": pytest.approx([200.0])}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plots.plot_latency_cdfs(r, tmp_path / "a.png") is None
        assert "matplotlib is not installed" in capsys.readouterr().err
        return
    for png in (plots.plot_latency_cdfs(r, tmp_path / "a.png"),
                plots.plot_sweep(found, tmp_path / "b.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert plots.plot_sweep({"probes": []}, tmp_path / "x.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_priority_mix_is_seeded_and_keeps_order():
    items = [WorkItem(f"p{i}", 100, 50, arrival_s=float(i)) for i in range(30)]
    mixed = priority_mix(items, 0.1, 8, 4, seed=3)
    assert mixed == priority_mix(items, 0.1, 8, 4, seed=3)
    assert [w.arrival_s for w in mixed] == [w.arrival_s for w in items]
    inter = [w for w in mixed if w.request_class == "interactive"]
    assert len(inter) == 3 and all(
        (w.prompt, w.prompt_len, w.output_len, w.priority) == (None, 8, 4, 0) for w in inter)
    batch = [w for w in mixed if w.request_class == "batch"]
    assert all(w.priority == 1 and w.prompt.startswith("p") for w in batch)
    assert all(w.request_class == "" and w.priority is None for w in items)
    assert priority_mix(items, 0.0, 8, 4) == [
        dataclasses.replace(w, priority=1, request_class="batch") for w in items]


def test_class_summary_percentiles():
    recs = [RequestRecord(10, 4, success=True, ttft=t, latency=t + 1.0, output_tokens=4,
                          request_class=c)
            for t, c in ((0.1, "interactive"), (0.3, "interactive"), (2.0, "batch"))]
    recs.append(RequestRecord(10, 4, success=False, request_class="batch"))
    out = class_summary(recs, [50.0, 99.0])
    assert set(out) == {"interactive", "batch"}
    assert out["interactive"]["median_ttft_ms"] == pytest.approx(200.0)
    assert out["interactive"]["p99_ttft_ms"] == pytest.approx(298.0)
    assert out["interactive"]["mean_e2el_ms"] == pytest.approx(1200.0)
    assert (out["batch"]["completed"], out["batch"]["failed"]) == (1, 1)
    assert class_summary([RequestRecord(1, 1, success=True)]) == {}
