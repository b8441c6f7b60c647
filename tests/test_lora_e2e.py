"""LoRA through a real server (issue 49), with the official openai client: a request names the
adapter as its `model` and gets PEFT's merged model's greedy tokens; the base model still
answers as itself; /v1/models lists the adapter under the base (and /v1/models/{id}
retrieves each card); an unknown model is a 404 model_not_found; an adapter loaded and
unloaded at run time while a stream runs."""

from __future__ import annotations

import time

import openai
import pytest
import torch

from tests.hf_models import build_hf_model
from tests.stack import Stack
from tests.test_engine_vs_hf import hf_greedy
from tests.test_lora import ALL, build_adapter

MODEL, MAX_NEW = "demo", 8


@pytest.fixture(scope="module")
def lora_stack(demo_model_dir, tmp_path_factory):
    """(the stack, its client, the adapter's dir, {"demo" and "A": HF's greedy outputs}, the
    prompts)."""
    from transformers import AutoModelForCausalLM

    adapter = tmp_path_factory.mktemp("lora") / "A"
    merged = build_adapter(demo_model_dir, adapter, 8, 16, True, ALL, 1)
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    prompts = [[1, 40, 41, 42, 43, 44], [1, 7, 300, 9]]
    expected = {MODEL: hf_greedy(base, prompts, MAX_NEW), "A": hf_greedy(merged, prompts, MAX_NEW)}
    stack = Stack(demo_model_dir, "--served-model-name", MODEL, "--dtype", "float32",
                  "--enable-lora", "--lora-modules", f"A={adapter}", "--max-lora-rank", "8",
                  "--max-loras", "2", "--allow-runtime-lora-updating").start()
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield stack, client, adapter, expected, prompts
    finally:
        stack.stop()


def test_adapter_named_as_model(lora_stack):
    _, client, _, expected, prompts = lora_stack
    assert expected["A"] != expected[MODEL]
    for model in ("A", MODEL):
        for prompt, want in zip(prompts, expected[model], strict=True):
            r = client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True}).model_dump()
            assert r["model"] == model
            assert r["choices"][0]["token_ids"] == want, model


def test_models_lists_the_adapter(lora_stack):
    _, client, adapter, _, _ = lora_stack
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert list(cards) == [MODEL, "A"]
    assert cards["A"]["parent"] == MODEL and cards["A"]["root"] == str(adapter)
    for name in cards:  # OpenAI's retrieve: one card
        assert client.models.retrieve(name).model_dump() == cards[name]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("B")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_metrics_lora_requests_info(lora_stack):
    stack = lora_stack[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the engine's stats come with its next heartbeat
        _, text = stack.get("/metrics")
        if "vllm:lora_requests_info{" in text:
            break
        time.sleep(0.2)
    assert 'vllm:lora_requests_info{max_lora="2"' in text


def test_unknown_model_is_404(lora_stack):
    _, client, _, _, _ = lora_stack
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="B", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found"


def test_load_generator_spreads_requests_over_adapters(lora_stack, tmp_path):
    """pipellm-bench --lora-modules (as vllm bench serve's): each request names one of the
    adapters as its model; an unknown one in the list fails its requests with the 404."""
    import json

    from pipellm.loadgen import cli

    stack = lora_stack[0]
    base = ["--base-url", stack.url, "--dataset-name", "random", "--random-input-len", "8",
            "--random-output-len", "4", "--num-prompts", "8", "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    assert cli.main([*base, "--lora-modules", "A", MODEL]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["completed"], r["lora_modules"]) == (8, ["A", MODEL])
    cli.main([*base, "--lora-modules", "A", "B"])
    r = json.loads((tmp_path / "r.json").read_text())
    failed = [e for e in r["errors"] if e]
    assert 0 < len(failed) < 8 and all("HTTP 404" in e for e in failed)  # seeded: both drawn


def test_chat_and_responses_name_the_adapter(lora_stack):
    """The chat path and the Responses API take the adapter's name too (and answer with it);
    the adapter's answer differs from the base's."""
    _, client, _, _, _ = lora_stack
    texts = {}
    for model in ("A", MODEL):
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Once upon a time"}],
            max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
        assert chat.model == model
        texts[model] = chat.choices[0].message.content
        resp = client.responses.create(model=model, input="Once upon a time",
                                       max_output_tokens=4, temperature=0, store=False)
        assert resp.model == model and resp.status in ("completed", "incomplete")
    assert texts["A"] != texts[MODEL]


def test_load_and_unload_at_run_time(lora_stack, tmp_path):
    """POST /v1/load_lora_adapter: served once the call returns (PEFT's merged tokens), listed;
    a stream of the other adapter runs through the load and the unload uncut; after
    /v1/unload_lora_adapter the name is a 404. Refused: a name in use, a rank over
    --max-lora-rank, an unknown name to unload."""
    stack, client, _, expected, prompts = lora_stack
    path = tmp_path / "C"
    merged = build_adapter(stack.model_dir, path, 4, 8, False, ["q_proj", "v_proj"], 5)
    want = hf_greedy(merged, prompts[:1], MAX_NEW)[0]
    stream = client.completions.create(model="A", prompt=prompts[0], max_tokens=MAX_NEW,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    first = next(iter(stream))
    assert stack.post("/v1/load_lora_adapter", {"lora_name": "C", "lora_path": str(path)})[0] \
        == 200
    assert [m.id for m in client.models.list().data] == [MODEL, "A", "C"]
    r = client.completions.create(model="C", prompt=prompts[0], max_tokens=MAX_NEW,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    assert r.model_dump()["choices"][0]["token_ids"] == want
    assert stack.post("/v1/unload_lora_adapter", {"lora_name": "C"})[0] == 200
    ids = first.model_dump()["choices"][0]["token_ids"]
    for chunk in stream:
        ids += chunk.model_dump()["choices"][0]["token_ids"] if chunk.choices else []
    assert ids == expected["A"][0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="C", prompt="hi", max_tokens=2)
    assert stack.post("/v1/unload_lora_adapter", {"lora_name": "C"})[0] == 404
    assert stack.post("/v1/load_lora_adapter", {"lora_name": "A", "lora_path": str(path)})[0] \
        == 400
    big = tmp_path / "big"
    build_adapter(stack.model_dir, big, 16, 16, False, ["q_proj"], 6)
    status, body = stack.post("/v1/load_lora_adapter", {"lora_name": "big",
                                                        "lora_path": str(big)})
    assert status == 400 and "max-lora-rank" in str(body)
    other = tmp_path / "other"
    build_hf_model(other, "llama", num_key_value_heads=2, num_hidden_layers=3)
    build_adapter(other, tmp_path / "X", 4, 8, False, ["q_proj"], 7)
    status, body = stack.post("/v1/load_lora_adapter", {"lora_name": "X",
                                                        "lora_path": str(tmp_path / "X")})
    assert status == 400 and "an adapter of another model?" in str(body), body
    assert [m.id for m in client.models.list().data] == [MODEL, "A"]


def test_kill_compute_mid_stream_keeps_the_adapter(lora_stack):
    """kill -9 of compute while an adapter's stream runs: the restarted compute (its
    --lora-modules loaded again) resumes it with the adapter, token for token the
    uninterrupted answer."""
    import os
    import signal

    stack, client, _, _, prompts = lora_stack
    kw = dict(model="A", prompt=prompts[0], max_tokens=300, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    want = client.completions.create(**kw).model_dump()["choices"][0]["token_ids"]
    old = stack.pid("compute")
    ids, killed = [], False
    for chunk in client.completions.create(stream=True, **kw):
        ids += chunk.model_dump()["choices"][0]["token_ids"] if chunk.choices else []
        if not killed:
            os.kill(old, signal.SIGKILL)
            killed = True
    assert stack.pid("compute") != old and "restarted; resum" in stack.logs()
    assert ids == want


def test_runtime_adapter_survives_a_compute_restart(lora_stack, tmp_path):
    """An adapter loaded at run time is kept in Redis: a compute killed and restarted loads it
    again before it is healthy, and it still answers with PEFT's merged tokens."""
    import os
    import signal

    stack, client, _, _, prompts = lora_stack
    path = tmp_path / "D"
    want = hf_greedy(build_adapter(stack.model_dir, path, 4, 8, False, ALL, 8), prompts[:1],
                     MAX_NEW)[0]
    assert stack.post("/v1/load_lora_adapter", {"lora_name": "D", "lora_path": str(path)})[0] \
        == 200
    old = stack.pid("compute")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while stack.pid("compute") == old or stack.get("/health")[0] != 200:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.2)
    try:
        r = client.completions.create(model="D", prompt=prompts[0], max_tokens=MAX_NEW,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
        assert r.model_dump()["choices"][0]["token_ids"] == want
    finally:
        assert stack.post("/v1/unload_lora_adapter", {"lora_name": "D"})[0] == 200
