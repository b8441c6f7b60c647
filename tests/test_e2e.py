"""End to end through HTTP: real processes, real Redis, real zmq sockets, on the demo model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import aiohttp
import openai
import pytest
import redis
import transformers

from pipellm.services.compute.backend import build_engine
from pipellm.shared.config import EngineConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import decode, encode, load_tokenizer
from tests.stack import Stack

MODEL = "demo-llama"


@pytest.fixture(scope="module")
def stack(demo_model_dir):
    s = Stack(demo_model_dir, "--served-model-name", MODEL, "--trust-request-chat-template").start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    """Greedy completions of the in-process engine, as text."""
    engine = build_engine(EngineConfig(model=str(demo_model_dir), device="cpu",
                                    kv_cache_tokens=4096))
    tok = load_tokenizer(demo_model_dir)

    def complete(prompt: str, max_tokens: int) -> str:
        seq = engine.generate([encode(tok, prompt)], SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
        return decode(tok, seq.output_ids)

    return complete


def test_completion_greedy_equals_engine_with_aiohttp_and_openai(stack, client, reference):
    expected = reference("The quick brown fox", 12)
    status, body = stack.post("/v1/completions", {
        "model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    # the detokenizer writes the state right after it sends the last tokens: read it until then
    deadline = time.monotonic() + 5
    while (st := stack.get(f"/v1/requests/{r.id}"))[1].get("status") != "finished" and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    status, st = st
    assert status == 200 and st["status"] == "finished" and st["completion_tokens"] == "12"
    assert float(st["queued_at"]) <= float(st["first_token_at"]) <= float(st["finished_at"])


def test_streaming_equals_non_streaming_and_reports_usage(client, reference):
    expected = reference("Once upon a time", 10)
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好！🌍"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content


def test_seeds_repeat_and_n_choices(client, demo_model_dir):
    def run(seed, n=1):
        return client.completions.create(model=MODEL, prompt="Tell me", max_tokens=10,
                                         temperature=1.0, seed=seed, n=n,
                                         extra_body={"ignore_eos": True})
    a, b, c = run(7), run(7), run(8)
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    multi = run(7, n=3)
    assert sorted(ch.index for ch in multi.choices) == [0, 1, 2]
    assert multi.choices[0].text == a.choices[0].text  # choice i uses seed + i
    prompt_tokens = len(encode(load_tokenizer(demo_model_dir), "Tell me"))
    assert multi.usage.completion_tokens == 30 and multi.usage.prompt_tokens == prompt_tokens


def test_stop_string_cuts_the_text(client, reference):
    text = reference("A stop test", 24)
    stop = text[8:11]
    assert stop.strip() and "\ufffd" not in stop
    r = client.completions.create(model=MODEL, prompt="A stop test", max_tokens=24,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_logprobs_of_chosen_tokens(client):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0,
                                  logprobs=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)


def test_best_of_returns_the_most_likely_choices(client):
    """best_of 3, n 2 answers the two of the three seeded choices (choice i samples with
    seed + i, as n 3 shows) with the highest cumulative logprob, best first."""
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=3, logprobs=0, **kw)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=3, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 24  # all three were generated


def test_logit_bias_forces_a_token(client, demo_model_dir):
    tok = load_tokenizer(demo_model_dir)
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0,
                                  logprobs=0, logit_bias={"321": 100},
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [decode(tok, [321])] * 6
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"100000": 1})


def test_stop_strings_tokens_and_special_tokens_in_the_text(client, demo_model_dir):
    """As vLLM: a stop string or stop token is left out of the text unless
    include_stop_str_in_output; special tokens are left out unless skip_special_tokens is
    false (forced here with logit_bias on <s>, id 1)."""
    tok = load_tokenizer(demo_model_dir)
    kw = dict(model=MODEL, prompt="Once upon", temperature=0)
    free = client.completions.create(max_tokens=8, extra_body={"ignore_eos": True}, **kw)
    text = free.choices[0].text
    stop = text[3:5]
    for include in (False, True):
        cut = client.completions.create(max_tokens=8, stop=[stop], **kw, extra_body={
            "ignore_eos": True, "include_stop_str_in_output": include})
        want = text[: text.index(stop) + (len(stop) if include else 0)]
        assert (cut.choices[0].text, cut.choices[0].finish_reason) == (want, "stop")
    ids = encode(tok, text)
    for include in (False, True):
        by_id = client.completions.create(max_tokens=8, **kw, extra_body={
            "ignore_eos": True, "stop_token_ids": [ids[2]], "include_stop_str_in_output": include})
        assert by_id.choices[0].text == decode(tok, ids[: 3 if include else 2])
    for skip in (True, False):
        forced = client.completions.create(max_tokens=2, logit_bias={"1": 100}, **kw,
                                           extra_body={"skip_special_tokens": skip})
        assert forced.choices[0].text == ("" if skip else "<s><s>")


def test_token_ids_for_rl_trainers(client, demo_model_dir):
    """return_token_ids: each choice's generated ids and its prompt's (completions: on the
    choice; chat: at the top), streamed (the prompt's on a choice's first chunk) or not;
    return_tokens_as_token_ids names logprob tokens "token_id:N"."""
    tok = load_tokenizer(demo_model_dir)
    kw = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={
        "return_token_ids": True, "ignore_eos": True, "return_tokens_as_token_ids": True})
    r = client.completions.create(prompt="Once upon", logprobs=1, **kw).model_dump()
    (choice,) = r["choices"]
    assert choice["prompt_token_ids"] == encode(tok, "Once upon")
    assert decode(tok, choice["token_ids"]) == choice["text"] and len(choice["token_ids"]) == 5
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    ids, prompt = [], None
    for chunk in client.completions.create(prompt="Once upon", stream=True, **kw):
        c = chunk.model_dump()["choices"][0]
        ids += c["token_ids"]
        prompt = prompt or c.get("prompt_token_ids")
    assert (ids, prompt) == (choice["token_ids"], choice["prompt_token_ids"])
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                          **kw).model_dump()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 5


def test_ranked_prompt_logprobs_as_vllm_gives_them(client, demo_model_dir):
    """vLLM's prompt_logprobs: [None, then per prompt token {id: {logprob, rank,
    decoded_token}} of the token and its k most likely]; chat's at the top (also on a stream's
    first chunk), a completion choice's its own, with echo's values where both are asked."""
    tok = load_tokenizer(demo_model_dir)
    kw = dict(model=MODEL, max_tokens=2, temperature=0)
    r = client.completions.create(prompt="Once upon a time", logprobs=2, echo=True,
                                  extra_body={"prompt_logprobs": 2}, **kw).model_dump()
    ranked, echo = r["choices"][0]["prompt_logprobs"], r["choices"][0]["logprobs"]
    ids = encode(tok, "Once upon a time")
    assert ranked[0] is None and len(ranked) == len(ids)
    for i, (tok_id, row) in enumerate(zip(ids[1:], ranked[1:], strict=True), start=1):
        mine = row[str(tok_id)]
        assert abs(mine["logprob"] - echo["token_logprobs"][i]) < 1e-5
        assert mine["decoded_token"] == decode(tok, [tok_id], skip_special_tokens=False)
        ranks = sorted(v["rank"] for v in row.values())
        # the 2 most likely, and the token itself: a third entry unless it is one of them
        assert ranks[:2] == [1, 2] and (mine["rank"] <= 2) == (len(row) == 2)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"prompt_logprobs": 1}, **kw).model_dump()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None and chat["choices"][0]["logprobs"] is None
    assert all(min(v["rank"] for v in row.values()) == 1 for row in chat["prompt_logprobs"][1:])
    first = next(iter(client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], stream=True,
        extra_body={"prompt_logprobs": 1}, **kw))).model_dump()
    assert first["prompt_logprobs"] == chat["prompt_logprobs"]


def test_allowed_token_ids_and_bad_words(client, demo_model_dir):
    """allowed_token_ids: only those are sampled; bad_words: a word the greedy output held is
    never generated again, streamed or not (vLLM's semantics)."""
    tok = load_tokenizer(demo_model_dir)
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=8, temperature=1.0, seed=3)
    only = client.completions.create(**kw, extra_body={
        "allowed_token_ids": [321, 322], "ignore_eos": True, "return_token_ids": True})
    assert set(only.model_dump()["choices"][0]["token_ids"]) <= {321, 322}
    greedy = dict(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0)
    body = {"ignore_eos": True, "return_token_ids": True}
    free = client.completions.create(**greedy, extra_body=body).model_dump()["choices"][0]
    # a generated token that is a word by itself, as a word that starts a text is tokenized
    tid, word = next((t, w) for t in free["token_ids"] if (w := decode(tok, [t])).strip() == w
                     and encode(tok, w, add_special_tokens=False) == [t])
    banned = client.completions.create(**greedy, extra_body={**body, "bad_words": [word]})
    out = banned.model_dump()["choices"][0]["token_ids"]
    assert out != free["token_ids"] and tid not in out
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(model=MODEL, prompt="x",
                                  extra_body={"allowed_token_ids": [10**6]})


def test_length_predictor_learns_from_finished_requests(stack, demo_model_dir):
    """Tokenizer features -> route -> detokenizer learns at finish -> Redis -> predictions."""
    from pipellm.shared.length_predictor import LengthPredictor, length_features, model_key

    key = model_key(str(demo_model_dir))
    predictor = LengthPredictor(redis.Redis.from_url(stack.redis.url), key, strict=True)
    before = sum(predictor.counts())
    for i in range(12):
        for prompt, n in ((f"zebra quickly please {i}", 2), (f"write a long story {i}", 40)):
            # min_tokens, not ignore_eos: a length only max_tokens can end teaches nothing
            status, body = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": n,
                                                          "min_tokens": n})
            assert status == 200 and body["usage"]["completion_tokens"] == n
    deadline = time.monotonic() + 5  # the detokenizer writes Redis after streaming the end
    while sum(predictor.counts()) < before + 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sum(predictor.counts()) == before + 24  # every finish learned once

    def median(prompt: str) -> int:
        ids = encode(load_tokenizer(demo_model_dir), prompt)
        return predictor.predict(length_features(prompt, ids, 64, key), 64).median

    assert median("zebra quickly please 99") < 10 < 20 < median("write a long story 99")


def test_hundred_concurrent_streams(stack):
    async def one(session, i):
        payload = {"model": MODEL, "prompt": f"Request number {i}", "max_tokens": 6,
                   "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}}
        text, usage, finish = "", None, None
        async with session.post(stack.url + "/v1/completions", json=payload) as r:
            assert r.status == 200
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    finish = chunk["choices"][0]["finish_reason"] or finish
                usage = chunk.get("usage") or usage
        return text, usage, finish

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(100)))

    results = asyncio.run(main())
    assert all(u["completion_tokens"] == 6 and f == "length" for _, u, f in results)
    status, body = stack.post("/v1/completions", {"model": MODEL, "prompt": "Request number 3",
                                                  "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True})
    assert body["choices"][0]["text"] == results[3][0]


def test_client_disconnect_frees_kv_within_a_second(stack):
    async def leave_early():
        payload = {"model": MODEL, "prompt": "Go on forever", "max_tokens": 1500,
                   "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(stack.url + "/v1/completions", json=payload) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        break
        return time.monotonic()

    left = asyncio.run(leave_early())
    while stack.engine_stats()["pipellm_kv_reserved"] > 0:
        assert time.monotonic() - left < 1.0, "KV not freed within a second"
        time.sleep(0.05)


BAD = [
    (b"{not json", 400, None),
    (b'["a list"]', 400, None),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 5000}, 400, None),  # over the 2048 context
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [999999]}, 400, "prompt"),  # token id outside the vocabulary
    ({"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ({"prompt": "x", "request_id": "a b"}, 400, "request_id"),
]


@pytest.mark.parametrize("payload,status,param", BAD)
def test_bad_input_gets_openai_error_and_server_keeps_serving(stack, payload, status, param):
    code, body = stack.post("/v1/completions", payload)
    assert code == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    code, body = stack.post("/v1/chat/completions", {"messages": []})
    assert code == 400 and body["error"]["param"] == "messages"
    assert stack.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200


def test_what_agent_frameworks_and_gateways_send(stack, client):
    """A developer message (the system's newer name), a field this server does not know
    (served, and logged), a request id in the body or the X-Request-Id header (the response's
    id and that header), priority 0 (any other under --scheduling-policy fcfs is a 400, as
    vLLM's); an id already in flight is a 400."""
    user = {"role": "user", "content": "hi"}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "developer", "content": "Be brief."}, user],
        extra_body={"request_id": "trace-1", "frobnicate": 1, "priority": 0})
    with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled") as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"priority": 5})
    assert e.value.body["param"] == "priority"
    chat = raw.parse()
    assert chat.id == "chatcmpl-trace-1" and raw.headers["x-request-id"] == "chatcmpl-trace-1"
    as_system = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, user])
    assert chat.choices[0].message.content == as_system.choices[0].message.content
    stack.wait_for_log("chatcmpl-trace-1: fields present in the request but ignored: frobnicate")
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123" and raw.parse().id == "cmpl-abc-123"
    with client.completions.create(model=MODEL, prompt="x", max_tokens=200, stream=True,
                                   extra_body={"request_id": "twice"}) as first:
        next(iter(first))
        with pytest.raises(openai.BadRequestError, match="already in use"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                      extra_body={"request_id": "twice"})


def test_batched_prompts_answer_each_prompt_as_alone(client, demo_model_dir):
    """A completion of several prompts (strings and token ids) answers prompt b's choice j at
    index b * n + j, each as the prompt alone would get it (seeded), streamed or not; usage
    counts every prompt once; echo and best_of work per prompt."""
    tok = load_tokenizer(demo_model_dir)
    prompts = ["Once upon a time", encode(tok, "The cat"), "A"]
    kw = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=11, n=2)
    batch = client.completions.create(prompt=prompts, **kw)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(6)] == [c.text for c in batch.choices]
    echoed = client.completions.create(prompt=prompts[::2], echo=True, best_of=3,
                                       **{**kw, "n": 1})
    assert [c.index for c in echoed.choices] == [0, 1]
    texts = [c.text for c in echoed.choices]
    assert texts[0].startswith(prompts[0]) and texts[1].startswith(prompts[2])


def test_prompt_fields_evaluation_and_agent_clients_send(client, demo_model_dir):
    """truncate_prompt_tokens keeps the last k prompt tokens; continue_final_message continues
    the assistant's last message; chat_template_kwargs reach the template; continuous usage
    stats put each choice's usage so far on every streamed chunk."""
    long = "one two three four five six seven eight nine ten"
    ids = encode(load_tokenizer(demo_model_dir), long)
    kw = dict(model=MODEL, max_tokens=3, temperature=0)
    for side, kept in (("left", ids[-4:]), ("right", ids[:4])):
        cut = client.completions.create(prompt=long, **kw, extra_body={
            "truncate_prompt_tokens": 4, "truncation_side": side})
        assert cut.usage.prompt_tokens == 4
        assert cut.choices[0].text == client.completions.create(prompt=kept, **kw
                                                                ).choices[0].text
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1 2 3"}]
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    went_on = client.chat.completions.create(
        messages=messages, extra_body={"continue_final_message": True,
                                       "add_generation_prompt": False,
                                       "chat_template_kwargs": {"enable_thinking": False}}, **kw)
    fresh = client.chat.completions.create(messages=messages, **kw)
    assert went_on.usage.prompt_tokens < fresh.usage.prompt_tokens  # no end of turn, no header
    echoed = client.chat.completions.create(
        messages=messages, extra_body={"continue_final_message": True, "echo": True,
                                       "add_generation_prompt": False}, **kw)
    assert echoed.choices[0].message.content == "1 2 3" + went_on.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages, stream=True, extra_body={
            "continue_final_message": True, "echo": True, "add_generation_prompt": False}, **kw)
        if c.choices)
    assert streamed == echoed.choices[0].message.content
    chunks = list(client.chat.completions.create(
        messages=messages[:1], stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": True}, **kw))
    counts = [c.usage.completion_tokens for c in chunks[:-1] if c.choices]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens


def test_a_requests_own_template_documents_and_special_tokens(client, demo_model_dir):
    """vLLM's chat_template (this server trusts them), documents (the template's variable) and
    add_special_tokens, through the openai SDK: the prompt is what transformers renders and
    tokenizes; prompt_embeds, which pipellm does not take, is a 400 rather than ignored."""
    hf = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    rag = ("{{ bos_token }}{% for d in documents %}[{{ d.text }}]{% endfor %}"
           "{% for m in messages %}{{ m.content }}{% endfor %}")
    docs = [{"text": "rivers run"}, {"text": "to the sea"}]
    messages = [{"role": "user", "content": "where"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"chat_template": rag, "documents": docs,
                                                   "return_token_ids": True})
    want = hf.apply_chat_template(messages, chat_template=rag, documents=docs, tokenize=True,
                                  return_dict=False)
    assert r.model_dump()["prompt_token_ids"] == want
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=1, extra_body={
        "return_token_ids": True})
    with_bos = client.completions.create(**kw).model_dump()["choices"][0]["prompt_token_ids"]
    kw["extra_body"]["add_special_tokens"] = False
    bare = client.completions.create(**kw).model_dump()["choices"][0]["prompt_token_ids"]
    assert (with_bos, bare) == (hf("Once upon")["input_ids"],
                                hf("Once upon", add_special_tokens=False)["input_ids"])
    with pytest.raises(openai.BadRequestError, match="prompt_embeds"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"prompt_embeds": "AAAA"})


def test_sagemaker_invocations_and_load(stack):
    """SageMaker's /invocations (vLLM's): the body's shape picks the API; /load counts the
    requests in flight."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0}
    status, via = stack.post("/invocations", chat)
    assert status == 200 and via["object"] == "chat.completion"
    assert via["choices"][0]["message"] == stack.post("/v1/chat/completions", chat)[1][
        "choices"][0]["message"]
    status, text = stack.post("/invocations", {"model": MODEL, "prompt": "Once", "max_tokens": 2})
    assert status == 200 and text["object"] == "text_completion"
    status, err = stack.post("/invocations", {"model": MODEL, "input": "x"})
    assert status == 400 and "Cannot find suitable handler" in err["error"]["message"]
    with urllib.request.urlopen(stack.url + "/load", timeout=10) as r:
        assert json.loads(r.read()) == {"server_load": 0}


def test_oversized_body_is_413(stack):
    code, body = stack.post("/v1/completions", b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}')
    assert code == 413 and body["error"]["code"] == "payload_too_large"


@pytest.mark.parametrize("service", ["tokenizer-0", "detokenizer"])
def test_killed_service_is_restarted(stack, service):
    old = stack.pid(service)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        code, body = stack.post("/v1/completions", {"prompt": "after", "max_tokens": 3})
        if code == 200 and stack.pid(service) != old:
            break
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.3)
    assert body["usage"]["completion_tokens"] >= 1


def test_redis_outage_gives_503_and_service_resumes(stack):
    stack.redis.stop()
    deadline = time.monotonic() + 10
    while stack.get("/health")[0] != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    code, body = stack.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 503 and body["error"]["type"] == "service_unavailable"
    stack.redis.start()  # same port: the services reconnect
    stack.wait_healthy(30)
    code, body = stack.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 200, body

