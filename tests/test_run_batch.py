"""`pipellm run-batch`: an OpenAI batch file through the engine, as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pipellm.services.compute.backend import build_engine
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.config import EngineConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import decode, encode, load_tokenizer

MODEL = "demo"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def line(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": MODEL, **body}})


@pytest.fixture(scope="module")
def engine(demo_model_dir):
    return build_engine(EngineConfig(model=str(demo_model_dir), kv_cache_tokens=4096))


def greedy_text(engine, tok, ids: list[int], n: int) -> str:
    seq = engine.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return decode(tok, seq[0].output_ids)


@pytest.fixture(scope="module")
def stop(engine, demo_model_dir) -> str:
    """A stop string from the middle of the greedy completion."""
    tok = load_tokenizer(demo_model_dir)
    text = greedy_text(engine, tok, encode(tok, "The quick brown fox"), 12)
    middle = len(text) // 2
    return text[middle : middle + 3]


@pytest.fixture(scope="module")
def results(demo_model_dir, tmp_path_factory, stop):
    tmp = tmp_path_factory.mktemp("batch")
    lines = [
        line("greedy", {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                        "ignore_eos": True, "logprobs": 2}),
        line("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                      "temperature": 0, "ignore_eos": True}, url="/v1/chat/completions"),
        "this is not json",
        line("bad-url", {"prompt": "x"}, url="/v1/embeddings"),
        line("other-model", {"prompt": "x", "model": "gpt-4"}),
        line("too-long", {"prompt": "x", "max_tokens": 10**6}),
        line("seeded", {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3,
                        "ignore_eos": True}),
        line("best", {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 2,
                      "best_of": 3, "ignore_eos": True}),
        line("stopped", {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True, "stop": [stop]}),
        line("echo-ids", {"prompt": [1, 200, 300], "echo": True, "max_tokens": 2,
                          "temperature": 0, "ignore_eos": True}),
        line("json", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                      "temperature": 1.0, "seed": 1, "n": 3, "response_format": {
                          "type": "json_schema", "json_schema": {"name": "j", "schema": SCHEMA}}},
             url="/v1/chat/completions"),
        line("regex", {"prompt": "x", "max_tokens": 20, "structured_outputs": {
            "regex": "[0-9]{4}"}}),
        line("bad-regex", {"prompt": "x", "structured_outputs": {"regex": "(["}}),
        line("messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                          "temperature": 0, "ignore_eos": True}, url="/v1/messages"),
        line("responses", {"input": "hi", "max_output_tokens": 9, "temperature": 0,
                           "ignore_eos": True}, url="/v1/responses"),
        line("chained", {"input": "hi", "previous_response_id": "resp_1"}, url="/v1/responses"),
    ]
    src, dst = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "run-batch",
                           "-i", str(src), "-o", str(dst), "--model", str(demo_model_dir),
                           "--served-model-name", MODEL, "--kv-cache-tokens", "4096"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    return proc, out


def test_one_output_line_per_input_line_in_order_and_a_closing_line(results):
    proc, out = results
    assert [o["custom_id"] for o in out] == [
        "greedy", "chat", None, "bad-url", "other-model", "too-long", "seeded", "best", "stopped",
        "echo-ids", "json", "regex", "bad-regex", "messages", "responses", "chained"]
    assert all(o["error"] is None and o["id"].startswith("batch_req_") for o in out)
    assert proc.stdout.strip().startswith("run-batch: 16 requests (6 failed), ")
    assert proc.stdout.strip().endswith("tok/s")
    assert "requests," in proc.stderr  # the progress bar


def test_answers_are_the_engines(results, engine, demo_model_dir):
    _, out = results
    tok = load_tokenizer(demo_model_dir)
    greedy = out[0]["response"]
    assert greedy["status_code"] == 200
    body = greedy["body"]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    expected = greedy_text(engine, tok, encode(tok, "The quick brown fox"), 12)
    assert body["choices"][0]["text"] == expected
    assert len(body["choices"][0]["logprobs"]["top_logprobs"]) == 12
    assert body["usage"]["completion_tokens"] == 12
    rendered = load_chat_template(demo_model_dir).render([{"role": "user", "content": "hi"}])
    chat = out[1]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == greedy_text(
        engine, tok, encode(tok, rendered, add_special_tokens=False), 9)


def test_messages_and_responses_lines_answer_in_their_shapes(results):
    """/v1/messages and /v1/responses lines: the chat line's greedy text, in Anthropic's and
    the Responses API's bodies; a chained response (nothing is stored) is a 400."""
    _, out = results
    chat = out[1]["response"]["body"]["choices"][0]["message"]["content"]
    msg = out[13]["response"]["body"]
    assert msg["type"] == "message" and msg["content"] == [{"type": "text", "text": chat}]
    assert msg["stop_reason"] == "max_tokens" and msg["usage"]["output_tokens"] == 9
    resp = out[14]["response"]["body"]
    assert resp["object"] == "response" and resp["status"] == "incomplete"
    assert resp["output"][0]["content"][0]["text"] == chat
    assert resp["usage"]["output_tokens"] == 9
    assert out[15]["response"]["status_code"] == 400


def test_bad_lines_get_their_errors(results):
    _, out = results
    statuses = {o["custom_id"]: o["response"]["status_code"] for o in out}
    assert statuses[None] == 400 and statuses["bad-url"] == 400
    assert statuses["other-model"] == 404 and statuses["too-long"] == 400
    too_long = out[5]["response"]["body"]["error"]
    assert "maximum context length" in too_long["message"]


def test_seeds_best_of_and_stop_strings(results, stop):
    _, out = results
    seeded = out[6]["response"]["body"]["choices"]
    best = out[7]["response"]["body"]
    assert len(seeded) == 3 and len({c["text"] for c in seeded}) > 1
    assert [c["text"] for c in best["choices"]] != [] and len(best["choices"]) == 2
    assert {c["text"] for c in best["choices"]} <= {c["text"] for c in seeded}
    assert best["usage"]["completion_tokens"] == 24
    full = out[0]["response"]["body"]["choices"][0]["text"]
    stopped = out[8]["response"]["body"]
    assert stopped["choices"][0]["text"] == full[: full.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < 12  # generation ended at the stop


def test_structured_outputs(results):
    """A batch line's response_format / structured_outputs hold as they do when served."""
    _, out = results
    choices = out[10]["response"]["body"]["choices"]
    done = [json.loads(c["message"]["content"]) for c in choices if c["finish_reason"] == "stop"]
    assert len(choices) == 3 and done and all(set(d) == {"n"} and 0 <= d["n"] <= 9 for d in done)
    answer = out[11]["response"]["body"]["choices"][0]
    assert answer["finish_reason"] == "stop" and re.fullmatch("[0-9]{4}", answer["text"])
    error = out[12]["response"]
    assert error["status_code"] == 400
    assert error["body"]["error"]["param"] == "structured_outputs.regex"


def test_echo_of_a_token_id_prompt_is_its_text(results, demo_model_dir):
    _, out = results
    tok = load_tokenizer(demo_model_dir)
    text = out[9]["response"]["body"]["choices"][0]["text"]
    prompt = tok.decode([1, 200, 300], skip_special_tokens=False)
    assert text.startswith(prompt) and len(text) > len(prompt)


def test_text_held_back_at_the_end_of_an_output_is_flushed(engine, demo_model_dir):
    """An output whose last token is half a character: the detokenizer holds its bytes back
    until the finish, then flushes them (as U+FFFD), as the server's detokenizer does; a copy
    of its per-token loop that forgets flush() loses them."""
    import io

    from pipellm.services.run_batch import run_batch
    from pipellm.services.tokenizer.service import Tokenizer

    tokenizer = Tokenizer(EngineConfig(model=str(demo_model_dir)))
    half = tokenizer.tok.token_to_id("\u00e2")  # byte-level BPE: the byte 0xE2 alone
    assert tokenizer.tok.decode([half]) == "\ufffd"
    body = {"prompt": "The quick brown fox", "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(half): 100}, "logprobs": 0}
    dst = io.StringIO()
    run_batch(engine, tokenizer, MODEL, [line("half", body)], dst, progress=None)
    choice = json.loads(dst.getvalue())["response"]["body"]["choices"][0]
    assert choice["logprobs"]["tokens"] == ["\ufffd"]  # the forced token was generated
    assert choice["text"] == "\ufffd" and choice["finish_reason"] == "length"


def test_auto_tool_choice_parses_calls_with_its_flags(demo_model_dir, tmp_path):
    """The tool flags as `pipellm serve` takes them: with none, tool_choice auto is on and the
    template's format (chatml_tools: hermes) parsed, so an auto line's hermes call (forced here
    by a regex, the demo model being random) comes back as tool_calls; --tool-call-parser
    without --enable-auto-tool-choice (vLLM's rule) makes auto a 400."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
            "tool_choice": "auto", "max_tokens": 200, "temperature": 0,
            "structured_outputs": {"regex": re.escape(call)}}
    src = tmp_path / "in.jsonl"
    src.write_text(line("auto", body, url="/v1/chat/completions") + "\n")
    answers = []
    for flags in ([], ["--tool-call-parser", "hermes"]):
        dst = tmp_path / "out.jsonl"
        proc = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "run-batch", "-i",
                               str(src), "-o", str(dst), "--model", str(demo_model_dir),
                               "--served-model-name", MODEL, "--kv-cache-tokens", "4096",
                               "--chat-template", "chatml_tools", *flags],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        answers.append(json.loads(dst.read_text())["response"])
    choice = answers[0]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (got,) = choice["message"]["tool_calls"]
    assert got["function"]["name"] == "get_weather"
    assert json.loads(got["function"]["arguments"]) == {"city": "Paris"}
    assert answers[1]["status_code"] == 400 and answers[1]["body"]["error"]["param"] == \
        "tool_choice"


def test_run_batch_answers_every_choice_as_the_server_does(demo_model_dir, tmp_path):
    """The same requests through `pipellm up` (one at a time, the official client) and through
    run-batch (all at once), both with n-gram speculation: beam search with n=2, a grammar,
    n>1 sampling with a seed, greedy, batched prompts (sampled, beams); every choice's text
    and finish reason agree."""
    import openai

    from tests.stack import Stack

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3, "disable_by_batch_size": 64})
    bodies = {
        "beam": {"prompt": "The capital of France is", "max_tokens": 10, "n": 2, "best_of": 3,
                 "use_beam_search": True},
        "regex": {"prompt": "x", "max_tokens": 20, "temperature": 1.0, "seed": 5,
                  "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
        "seeded": {"prompt": "Once", "max_tokens": 10, "temperature": 0.8, "top_p": 0.9,
                   "seed": 11, "n": 3, "ignore_eos": True},
        "greedy": {"prompt": "a b c a b c a b", "max_tokens": 16, "temperature": 0,
                   "ignore_eos": True},
        "batched": {"prompt": ["Once", [5, 6, 7]], "max_tokens": 8, "temperature": 0.8,
                    "seed": 3, "n": 2, "ignore_eos": True},
        "batched beams": {"prompt": ["The capital of", "x y"], "max_tokens": 6, "n": 2,
                          "best_of": 2, "use_beam_search": True},
    }
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(line(k, b) + "\n" for k, b in bodies.items()))
    proc = subprocess.run([sys.executable, "-m", "pipellm.services.cli", "run-batch",
                           "-i", str(src), "-o", str(dst), "--model", str(demo_model_dir),
                           "--served-model-name", MODEL, "--kv-cache-tokens", "4096",
                           "--speculative-config", spec],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    batch = {o["custom_id"]: o["response"]["body"]["choices"]
             for o in map(json.loads, dst.read_text().splitlines())}
    stack = Stack(demo_model_dir, "--served-model-name", MODEL, "--speculative-config",
                  spec).start()
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        for key, body in bodies.items():
            standard = {k: v for k, v in body.items() if k in ("prompt", "max_tokens", "n",
                        "best_of", "temperature", "top_p", "seed")}
            extra = {k: v for k, v in body.items() if k not in standard}
            served = client.completions.create(model=MODEL, extra_body=extra, **standard)
            want = [(c.text, c.finish_reason) for c in sorted(served.choices,
                                                             key=lambda c: c.index)]
            got = [(c["text"], c["finish_reason"]) for c in sorted(batch[key],
                                                                  key=lambda c: c["index"])]
            assert got == want, key
            prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
            assert len(got) == body.get("n", 1) * prompts, key
    finally:
        stack.stop()
