"""run-batch and a line's priority (issue 51): it reaches the engine's Sequence as the served
path's does; under --scheduling-policy fcfs a non-zero one is that line's 400, the others run."""

from __future__ import annotations

import io
import json

import pytest

from pipellm.services.compute.backend import build_engine
from pipellm.services.run_batch import BatchRunner, run_batch
from pipellm.services.tokenizer.service import Tokenizer
from pipellm.shared.config import EngineConfig, SchedulerConfig, SchedulingPolicyName

MODEL = "demo"


def line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": MODEL, "max_tokens": 3, "temperature": 0,
                                "ignore_eos": True, **body}})


def engine_with(demo_model_dir, policy: SchedulingPolicyName):
    return build_engine(EngineConfig(model=str(demo_model_dir), kv_cache_tokens=4096,
                                     scheduler=SchedulerConfig(scheduling_policy=policy)))


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return Tokenizer(EngineConfig(model=str(demo_model_dir)))


def test_a_priority_under_fcfs_is_its_lines_400_and_the_others_run(demo_model_dir, tokenizer):
    engine = engine_with(demo_model_dir, SchedulingPolicyName.FCFS)
    dst = io.StringIO()
    lines = [line("urgent", {"prompt": "x", "priority": 3}), line("plain", {"prompt": "x"}),
             line("zero", {"messages": [{"role": "user", "content": "hi"}], "priority": 0},
                  url="/v1/chat/completions")]
    n, failed, _, _ = run_batch(engine, tokenizer, MODEL, lines, dst, progress=None)
    out = {o["custom_id"]: o["response"] for o in map(json.loads, dst.getvalue().splitlines())}
    assert (n, failed) == (3, 1)
    assert out["urgent"]["status_code"] == 400
    error = out["urgent"]["body"]["error"]
    assert error["param"] == "priority" and "Priority scheduling is not enabled" in error["message"]
    assert out["plain"]["status_code"] == 200 and out["zero"]["status_code"] == 200
    assert len(out["plain"]["body"]["choices"][0]["text"]) > 0


@pytest.mark.parametrize("policy", [SchedulingPolicyName.PRIORITY, SchedulingPolicyName.PREDICTED])
def test_a_lines_priority_reaches_the_engines_sequence(demo_model_dir, tokenizer, policy):
    engine = engine_with(demo_model_dir, policy)
    runner = BatchRunner(engine, tokenizer, MODEL)
    items = [runner.parse(line("low", {"prompt": "x", "priority": 7})),
             runner.parse(line("high", {"messages": [{"role": "user", "content": "hi"}],
                                        "priority": -2, "n": 2}, url="/v1/chat/completions")),
             runner.parse(line("default", {"input": "hi", "max_output_tokens": 3},
                               url="/v1/responses"))]
    for item in items:
        runner.submit(item)
    assert all(item.error is None for item in items)
    queued = {s.request_id: s.priority for s in engine.scheduler.waiting}
    expect = {choice: p for item, p in zip(items, (7, -2, 0), strict=True)
              for choice in item.choices}
    assert len(expect) == 4 and queued == expect
    runner.run(lambda tokens: None)
    assert [runner.output(i)["response"]["status_code"] for i in items] == [200, 200, 200]
