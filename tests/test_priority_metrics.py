"""/metrics per priority (issue 51): the server (real services, --scheduling-policy priority)
observes each request's TTFT and queue time under its `priority` label; the label set is
bounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pipellm.services.gateway.metrics import PRIORITY_SERIES, ByPriority
from tests.stack import Stack

NAMES = ("pipellm_time_to_first_token_by_priority_seconds_count",
         "pipellm_request_queue_time_by_priority_seconds_count")


def counts(text: str) -> dict[tuple[str, str], float]:
    """{(sample name, priority): value} of the per-priority histograms' counts."""
    return {(s.name, s.labels["priority"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in NAMES}


def test_requests_show_up_under_their_priority(demo_model_dir):
    stack = Stack(demo_model_dir, "--served-model-name", "demo", "--scheduling-policy",
                  "priority", embedded_redis=True).start()
    try:
        body = {"model": "demo", "prompt": "The quick brown fox", "max_tokens": 3,
                "temperature": 0}
        for priority, stream in ((3, False), (3, True), (0, False)):
            status, _ = stack.post("/v1/completions",
                                   {**body, "priority": priority, "stream": stream})
            assert status == 200
        status, _ = stack.post("/v1/chat/completions", {
            "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "priority": -5})
        assert status == 200
        _, text = stack.get("/metrics")
    finally:
        stack.stop()
    got = counts(text)
    for name in NAMES:
        assert (got[(name, "3")], got[(name, "0")], got[(name, "-5")]) == (2, 1, 1), got
    assert {p for _, p in got} == {"3", "0", "-5"}


def test_priorities_past_the_bound_share_one_series():
    hist = ByPriority("t_seconds", "t", (1.0,), CollectorRegistry())
    for p in range(PRIORITY_SERIES + 5):
        hist.observe(p, 0.5)
    hist.observe(0, 0.5)  # one seen before the bound keeps its own
    labels = {s.labels["priority"]: s.value for s in hist.histogram.collect()[0].samples
              if s.name == "t_seconds_count"}
    assert labels["other"] == 5 and labels["0"] == 2 and len(labels) == PRIORITY_SERIES + 1
