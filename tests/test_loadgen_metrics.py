"""Load generator, pure parts: metrics against hand-computed cases, arrival schedules, loaders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipellm.loadgen import arrivals
from pipellm.loadgen.datasets import (
    WorkItem,
    clip_to_context,
    load_azure_trace,
    random_items,
    sample_sharegpt,
)
from pipellm.loadgen.metrics import (
    RequestRecord,
    parse_slos,
    peak_concurrency,
    peak_output_per_s,
    per_request,
    summarize,
)


def _records() -> list[RequestRecord]:
    return [
        # 4 tokens: TTFT 100 ms, gaps 20/30/50 ms, E2EL 200 ms -> TPOT (200-100)/3 ms
        RequestRecord(10, 4, True, "", 0.0, 0.1, [0.02, 0.03, 0.05], 0.2, 4),
        # 1 token: TTFT = E2EL = 300 ms, TPOT undefined
        RequestRecord(20, 4, True, "", 1.5, 0.3, [], 0.3, 1),
        RequestRecord(30, 4, False, "HTTP 500: boom", 0.7),
    ]


def test_summary_matches_hand_computation():
    s = summarize(_records(), 2.0, [50, 99], slos={"ttft": 150})
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 5)  # failed excluded
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 2.5
    assert s["total_token_throughput"] == 17.5
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)
    assert s["p50_ttft_ms"] == pytest.approx(200)
    # TPOT only from the 4-token request
    for key in ("mean", "median", "p99"):
        assert s[f"{key}_tpot_ms"] == pytest.approx(100 / 3)
    assert s["std_tpot_ms"] == pytest.approx(0)
    # ITL pools every gap: [20, 30, 50]
    assert s["mean_itl_ms"] == pytest.approx(100 / 3) and s["median_itl_ms"] == pytest.approx(30)
    assert s["p99_itl_ms"] == pytest.approx(30 + 0.98 * 20)
    assert s["mean_e2el_ms"] == pytest.approx(250) and s["p99_e2el_ms"] == pytest.approx(299)
    assert s["request_goodput"] == pytest.approx(0.5)  # only the 100 ms TTFT meets 150 ms
    assert s["max_output_tokens_per_s"] == 4  # all of request 1 in [0, 1); request 2 in [1, 2)
    assert s["max_concurrent_requests"] == 1


@pytest.mark.parametrize("slos,good", [
    ({"tpot": 40}, 2),  # 33 ms meets; the 1-token request counts as TPOT 0
    ({"tpot": 30}, 1),  # 33 ms misses; the 1-token request still meets
    ({"ttft": 400, "e2el": 250}, 1),  # both need to hold
    ({"ttft": 0}, 0),
    ({"ttft": 300, "tpot": 100 / 3 + 1e-9, "e2el": 300}, 2),  # limits are inclusive
])
def test_goodput_slos(slos, good):
    assert summarize(_records(), 4.0, slos=slos)["request_goodput"] == pytest.approx(good / 4)


def test_goodput_absent_without_slos_and_percentiles_configurable():
    s = summarize(_records(), 1.0, [90, 99.9], ["ttft", "e2el"])
    assert s["request_goodput"] is None
    assert {"p90_ttft_ms", "p99.9_ttft_ms", "p90_e2el_ms"} <= set(s)
    assert "p99_ttft_ms" not in s and "mean_tpot_ms" not in s and "mean_itl_ms" not in s


def test_no_successes_gives_zeros():
    recs = [RequestRecord(5, 4, False, "x"), RequestRecord(6, 4, False, "y")]
    s = summarize(recs, 1.0, slos={"ttft": 1000})
    assert (s["completed"], s["failed"], s["total_input_tokens"]) == (0, 2, 0)
    assert s["request_goodput"] == 0 and s["max_output_tokens_per_s"] == 0
    assert all(s[f"{k}_{m}_ms"] == 0 for k in ("mean", "median", "p99")
               for m in ("ttft", "tpot", "itl", "e2el"))
    assert per_request(recs)["output_lens"] == [0, 0]
    assert per_request(recs)["errors"] == ["x", "y"]


def test_all_one_token_outputs_have_no_tpot_values():
    recs = [RequestRecord(5, 1, True, "", 0.0, 0.05, [], 0.05, 1)]
    assert recs[0].tpot is None
    s = summarize(recs, 1.0, slos={"tpot": 0})
    assert s["mean_tpot_ms"] == 0 and s["mean_itl_ms"] == 0 and s["request_goodput"] == 1.0


def test_peak_output_weights_multi_token_chunks_and_concurrency_overlaps():
    a = RequestRecord(1, 8, True, "", 0.0, 0.5, [0.1, 0.1, 0.1], 0.8, 8)  # 4 chunks, 8 tokens
    b = RequestRecord(1, 2, True, "", 0.7, 0.5, [0.1], 0.6, 2)  # tokens at 1.2, 1.3
    assert peak_output_per_s([a, b]) == 8
    assert peak_concurrency([a, b]) == 2
    c = RequestRecord(1, 2, True, "", 0.8, 0.1, [], 0.1, 1)  # starts as a ends: no overlap
    assert peak_concurrency([a, c]) == 1


def test_parse_slos():
    assert parse_slos(["ttft:3000", "tpot:50.5"]) == {"ttft": 3000.0, "tpot": 50.5}
    assert parse_slos(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["e2el:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    with pytest.raises(ValueError):
        summarize(_records(), 0.0)


# ---------------------------------------------------------------- arrivals


def _gaps(times: list[float]) -> np.ndarray:
    return np.diff([0.0, *times])


def test_poisson_is_deterministic_per_seed():
    a = arrivals.poisson(200, 5.0, 1.0, seed=1)
    assert a == arrivals.poisson(200, 5.0, 1.0, seed=1)
    assert a != arrivals.poisson(200, 5.0, 1.0, seed=2)
    assert all(x <= y for x, y in zip(a, a[1:], strict=False)) and a[0] > 0


def test_poisson_rate_and_shape():
    n, rate = 20000, 10.0
    gaps = _gaps(arrivals.poisson(n, rate, 1.0, seed=0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)  # scaled to end at n / rate
    assert np.median(gaps) == pytest.approx(math.log(2) / rate, rel=0.05)  # exponential
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("burstiness,cv", [(0.25, 2.0), (4.0, 0.5)])
def test_burstiness_sets_the_spread_of_gaps(burstiness, cv):
    gaps = _gaps(arrivals.poisson(20000, 10.0, burstiness, seed=3))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # gamma CV = 1/sqrt(shape)


def test_even_infinite_and_trace_schedules():
    assert arrivals.poisson(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert arrivals.poisson(3, math.inf) == [0.0, 0.0, 0.0] == arrivals.burst(3)
    assert arrivals.poisson(0, 1.0) == []
    assert arrivals.trace([10.0, 11.0, 13.0], 0.5) == [0.0, 0.5, 1.5]
    with pytest.raises(ValueError):
        arrivals.trace([2.0, 1.0])
    with pytest.raises(ValueError):
        arrivals.poisson(3, 0.0)


# ---------------------------------------------------------------- datasets


def _conv(q: str, a: str) -> dict:
    return {"id": "x", "conversations": [{"from": "human", "value": q},
                                         {"from": "gpt", "value": a}]}


def test_sample_sharegpt_filters_shuffles_and_oversamples(tmp_path: Path):
    path = tmp_path / "sg.json"
    good = [_conv(f"question {i} " + "q" * 40, "a" * 80) for i in range(5)]
    bad = [_conv("hi", "a" * 80),  # prompt under 4 tokens
           _conv("q" * 40, "ok"),  # answer under 4 tokens
           _conv("q" * 4200, "a" * 40),  # prompt over 1024 tokens
           _conv("q" * 3000, "a" * 6000)]  # prompt + answer over 2048
    path.write_text(json.dumps(bad + good), encoding="utf-8")
    items = sample_sharegpt(path, 5, seed=0)
    assert sorted(w.prompt for w in items) == sorted(c["conversations"][0]["value"] for c in good)
    assert all(w.output_len == 20 and w.arrival_s is None for w in items)
    assert items == sample_sharegpt(path, 5, seed=0)
    assert [w.prompt for w in items] != [w.prompt for w in sample_sharegpt(path, 5, seed=1)]
    more = sample_sharegpt(path, 12, seed=0)
    assert len(more) == 12 and more[5:10] == items and more[10:] == items[:2]
    path.write_text(json.dumps(bad), encoding="utf-8")
    with pytest.raises(ValueError):
        sample_sharegpt(path, 3)


def test_load_azure_trace(tmp_path: Path):
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:16:01,0,0\n"
                    "2023-11-16 18:16:02,5,5\n", encoding="utf-8")
    items = load_azure_trace(path, limit=3)
    assert [(w.prompt, w.prompt_len, w.output_len) for w in items] == [
        (None, 374, 44), (None, 396, 109), (None, 1, 1)]
    assert [w.arrival_s for w in items] == pytest.approx([0.0, 4.314579, 14.31941])
    numeric = tmp_path / "n.csv"
    numeric.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n5.5,10,2\n7.0,20,3\n")
    assert [w.arrival_s for w in load_azure_trace(numeric)] == [0.0, 1.5]


def test_random_items_ranges():
    fixed = random_items(50, 100, 20, 0.0, seed=1)
    assert {(w.prompt_len, w.output_len) for w in fixed} == {(100, 20)}
    ranged = random_items(500, 100, 20, 0.5, seed=1)
    assert ranged == random_items(500, 100, 20, 0.5, seed=1)
    assert min(w.prompt_len for w in ranged) == 50 and max(w.prompt_len for w in ranged) == 150
    assert {w.output_len for w in ranged} == set(range(10, 31))
    with pytest.raises(ValueError):
        random_items(1, 10, 10, 1.0)


def test_clip_to_context():
    items = [WorkItem("keep", 100, 100), WorkItem("long prompt", 3000, 50),
             WorkItem("long output", 100, 5000)]
    out = clip_to_context(items, 2048)
    assert out[0] is items[0]
    assert (out[1].prompt, out[1].prompt_len, out[1].output_len) == (None, 1024, 50)
    assert (out[2].prompt, out[2].prompt_len, out[2].output_len) == ("long output", 100, 1948)
