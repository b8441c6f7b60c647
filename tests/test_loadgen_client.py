"""Load generator against an in-process fake OpenAI server: SSE parsing, errors, concurrency,
arrival timing, prompt calibration, and the CLI's glue (fast; the real stack is in _e2e)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from pipellm.loadgen import cli, client, runner
from pipellm.loadgen.client import Endpoint
from pipellm.loadgen.datasets import WorkItem
from pipellm.loadgen.runner import RunConfig
from pipellm.shared.redis_server import free_port

ANCHOR_TOKENS = 3  # the fake tokenizer: 3 tokens of overhead, a word costs len // 4 + 1


def fake_tokens(text: str) -> int:
    return ANCHOR_TOKENS - 1 + sum(len(w) // 4 + 1 for w in text.split())


class FakeServer:
    """Streams one chunk per token, 5 ms apart; behaviour chosen by the prompt's first word."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.inflight = self.max_inflight = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake", "max_model_len": 64}]})

    async def complete(self, request):
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n = body.get("max_completion_tokens") or body.get("max_tokens")
        usage = {"prompt_tokens": fake_tokens(prompt), "completion_tokens": n}
        if prompt.startswith("bad"):
            return web.json_response({"error": {"message": "no"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x"}], "usage": usage})
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self._stream(request, prompt, n, chat, usage, body)
        finally:
            self.inflight -= 1

    async def _stream(self, request, prompt, n, chat, usage, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0 if prompt.startswith("empty") else n):
            await asyncio.sleep(0.005)
            choice = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            if prompt.startswith("midstream"):
                await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
                break
        if body.get("stream_options", {}).get("include_usage") and "nousage" not in prompt:
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                             + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    yield s
    s.stop()


def _send(ep: Endpoint, prompt: str, n: int = 3):
    async def go():
        async with client.session() as s:
            return await client.send(s, ep, prompt, 7, n)
    return asyncio.run(go())


def test_stream_timing_usage_and_text(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        rec = _send(Endpoint(server.url, path, "fake"), "hello there", 4)
        assert rec.success and rec.error == ""
        assert rec.output_tokens == 4 and rec.prompt_len == fake_tokens("hello there")
        assert rec.generated_text == "t0t1t2t3"
        # the server sleeps 5 ms between chunks: one late chunk shortens the next gap, never
        # the span from the first to the last
        assert len(rec.itl) == 3 and all(g >= 0 for g in rec.itl) and sum(rec.itl) > 0.014
        assert 0.004 < rec.ttft < rec.latency
        assert rec.latency >= rec.ttft + sum(rec.itl) - 1e-6


def test_failures_are_recorded_not_raised(server):
    ep = Endpoint(server.url, model="fake")
    bad = _send(ep, "bad request")
    assert not bad.success and bad.error.startswith("HTTP 400") and bad.prompt_len == 7
    mid = _send(ep, "midstream please")
    assert not mid.success and "engine died" in mid.error
    empty = _send(ep, "empty stream")
    assert not empty.success and "no output" in empty.error
    gone = _send(Endpoint(f"http://127.0.0.1:{free_port()}", model="fake"), "x")
    assert not gone.success and "ClientConnectorError" in gone.error


def test_output_tokens_fall_back_to_chunk_count(server):
    rec = _send(Endpoint(server.url, model="fake"), "nousage here", 5)
    assert rec.success and rec.output_tokens == 5 and rec.prompt_len == 7


def test_payloads(server):
    server.bodies.clear()
    _send(Endpoint(server.url, model="fake", ignore_eos=True, extra_body={"temperature": 0}),
          "p", 9)
    _send(Endpoint(server.url, "/v1/chat/completions", "fake"), "q", 2)
    first, chat = server.bodies
    assert first == {"model": "fake", "stream": True, "prompt": "p", "max_tokens": 9,
                     "stream_options": {"include_usage": True}, "ignore_eos": True,
                     "temperature": 0}
    assert chat["messages"] == [{"role": "user", "content": "q"}]
    assert chat["max_completion_tokens"] == 2 and "ignore_eos" not in chat


def test_runner_caps_concurrency_and_keeps_order(server):
    server.max_inflight = 0
    items = [WorkItem(f"item {i}", 5, 4 + i % 3) for i in range(8)]
    cfg = RunConfig(Endpoint(server.url, model="fake"), max_concurrency=2, progress=False)
    records, duration = runner.run(cfg, items, [0.0] * 8)
    assert server.max_inflight == 2
    assert [r.output_tokens for r in records] == [4 + i % 3 for i in range(8)]
    assert all(r.success for r in records) and max(r.queue_time for r in records) > 0.01
    assert duration >= max(r.start_time + r.latency for r in records) - 1e-6


def test_runner_sends_at_arrival_offsets_after_warmup(server):
    server.bodies.clear()
    items = [WorkItem(f"timed {i}", 5, 1) for i in range(3)]
    cfg = RunConfig(Endpoint(server.url, model="fake"), warmup_requests=2, progress=False)
    t0 = time.perf_counter()
    records, duration = runner.run(cfg, items, [0.0, 0.15, 0.3])
    assert [r.start_time for r in records] == pytest.approx([0.0, 0.15, 0.3], abs=0.03)
    assert 0.3 < duration < time.perf_counter() - t0
    assert [b["prompt"] for b in server.bodies] == ["timed 0"] * 3 + ["timed 1", "timed 2"]


def test_calibrated_prompts_hit_their_targets(server):
    pm = runner.prompt_model(Endpoint(server.url, model="fake"))
    assert pm is not None and pm.anchor_tokens == ANCHOR_TOKENS
    import random

    rng = random.Random(0)
    for target in (3, 4, 10, 57, 300):
        text = pm.text(target, rng)
        assert fake_tokens(text) == target == pm.length(text)
    assert pm.text(1, rng) == "the"  # below the anchor: the anchor alone


def test_cli_run_saves_vllm_keys(server, tmp_path: Path):
    server.bodies.clear()
    rc = cli.main(["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "5",
                   "--random-input-len", "100", "--random-output-len", "3", "--disable-tqdm",
                   "--goodput", "ttft:10000", "--save-result", "--result-dir", str(tmp_path),
                   "--result-filename", "out.json"])
    assert rc == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["model_id"] == "fake" and result["completed"] == 5
    assert result["input_lens"] == [32] * 5  # clipped to half the 64-token context, exactly
    assert result["output_lens"] == [3] * 5
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    streamed = [b for b in server.bodies if b.get("stream")]
    assert len(streamed) == 5 and all(b["ignore_eos"] for b in streamed)
    assert len({b["prompt"] for b in streamed}) == 5  # distinct prompts


@pytest.mark.parametrize("argv,code,message", [
    (["--goodput", "itl:5"], 2, "itl"),
    (["--sweep", "--mode", "burst"], 2, "--sweep needs --mode poisson"),
    (["--mode", "trace"], 2, "needs --dataset-name azure"),
    (["--percentile-metrics", "ttft,foo"], 2, "foo"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent.json"], 1, "nonexistent"),
])
def test_cli_usage_errors(server, capsys, argv, code, message):
    assert cli.main(["--base-url", server.url, *argv]) == code
    assert message in capsys.readouterr().err


def test_cli_unreachable_server(capsys):
    assert cli.main(["--base-url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "error: ClientConnectorError" in capsys.readouterr().err


def test_cli_replays_a_trace_time_scaled(server, tmp_path: Path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.0,20,3\n2023-11-16 18:15:48.0,9,2\n"
                     "2023-11-16 18:15:50.0,30,4\n2023-11-16 18:15:52.0,5,1\n")
    argv = ["--base-url", server.url, "--dataset-name", "azure", "--dataset-path", str(trace),
            "--num-prompts", "3", "--trace-time-scale", "0.1", "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "t.json"]
    assert cli.main(argv) == 0
    r = json.loads((tmp_path / "t.json").read_text())
    assert r["mode"] == "trace" and r["trace_time_scale"] == 0.1
    assert r["start_times"] == pytest.approx([0.0, 0.2, 0.4], abs=0.04)
    assert r["input_lens"] == [20, 9, 30] and r["output_lens"] == [3, 2, 4]


def test_cli_priority_mix_sends_priorities_and_reports_classes(server, tmp_path: Path, capsys):
    """--interactive-fraction: a seeded tenth of the requests are interactive (their own
    lengths, priority 0), the rest batch (priority 1); the result holds each class's TTFT and
    E2EL percentiles and the per-request classes."""
    server.bodies.clear()
    argv = ["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "20",
            "--random-input-len", "20", "--random-output-len", "6", "--disable-tqdm",
            "--interactive-fraction", "0.1", "--interactive-input-len", "8",
            "--interactive-output-len", "2", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "mix.json"]
    assert cli.main(argv) == 0
    result = json.loads((tmp_path / "mix.json").read_text())
    streamed = [b for b in server.bodies if b.get("stream")]
    assert sorted(b["priority"] for b in streamed) == [0] * 2 + [1] * 18
    assert all(b["max_tokens"] == (2 if b["priority"] == 0 else 6) for b in streamed)
    classes = result["request_classes"]
    assert classes.count("interactive") == 2 and classes.count("batch") == 18
    assert [n for c, n in zip(classes, result["output_lens"], strict=True)
            if c == "interactive"] == [2, 2]
    inter = result["classes"]["interactive"]
    assert (inter["completed"], inter["failed"]) == (2, 0)
    assert 0 < inter["median_ttft_ms"] <= inter["p99_ttft_ms"] < inter["p99_e2el_ms"]
    assert result["classes"]["batch"]["completed"] == 18
    assert result["interactive_fraction"] == 0.1 and result["batch_priority"] == 1
    out = capsys.readouterr().out
    assert "class interactive" in out and "P99 TTFT (ms)" in out
    server.bodies.clear()  # the same traffic for an fcfs server: every request at priority 0
    assert cli.main([*argv, "--batch-priority", "0"]) == 0
    assert {b["priority"] for b in server.bodies if b.get("stream")} == {0}


def test_no_priority_field_without_a_mix(server, tmp_path: Path):
    server.bodies.clear()
    assert cli.main(["--base-url", server.url, "--dataset-name", "random", "--num-prompts", "3",
                     "--random-input-len", "8", "--random-output-len", "2",
                     "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                     "--result-filename", "plain.json"]) == 0
    assert not any("priority" in b for b in server.bodies)
    result = json.loads((tmp_path / "plain.json").read_text())
    assert "classes" not in result and "request_classes" not in result


@pytest.mark.parametrize("argv,message", [
    (["--interactive-fraction", "1.5"], "--interactive-fraction must be in [0, 1]"),
    (["--interactive-fraction", "0.1", "--mode", "throughput"], "not --mode throughput"),
])
def test_priority_mix_usage_errors(server, capsys, argv, message):
    assert cli.main(["--base-url", server.url, *argv]) == 2
    assert message in capsys.readouterr().err
