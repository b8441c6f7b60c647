"""The reference real model, SmolLM2-135M-Instruct (Q4_1 GGUF, fetched by the test command into
the cache), against transformers' own GGUF loading of the same file, in float32
(`--quantization none`: the float copy; the INT4 path is tests/test_quantization.py)."""

from __future__ import annotations

import copy
import json
import random
import weakref
from pathlib import Path

import openai
import pytest
import regex
import torch
from tokenizers import pre_tokenizers

from pipellm.services.compute.backend import build_engine
from pipellm.shared import default_model
from pipellm.shared.chat_template import load_chat_template
from pipellm.shared.config import EngineConfig
from pipellm.shared.sampling import SamplingParams
from pipellm.shared.tokenizer import load_tokenizer
from tests.stack import Stack

SHAREGPT = Path(__file__).resolve().parents[1] / "data/sharegpt_samples_1024.json"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "How do I reverse a list in Python?", "Give me three tips for sleeping better."]
COMPLETIONS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The theory of relativity states that"]
MAX_NEW = 32


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model.fetch()  # fails (never skips) when the test command could not fetch it


@pytest.fixture(scope="module")
def hf(smollm2_hf):
    """(transformers model, transformers tokenizer), both loaded by transformers from the GGUF
    (tests/conftest.py)."""
    return smollm2_hf


@pytest.fixture(scope="module")
def prompts(gguf_path) -> list[list[int]]:
    tok, template = load_tokenizer(gguf_path), load_chat_template(gguf_path)
    chats = [template.encode(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return chats + [tok.encode(p).ids for p in COMPLETIONS]


_greedy: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {prompt: ids}


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, up to and including EOS (once per model and prompt)."""
    memo = _greedy.setdefault(model, {})
    if tuple(prompt) not in memo:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                 do_sample=False)
        memo[tuple(prompt)] = out[0, len(prompt):].tolist()
    return list(memo[tuple(prompt)])


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1] log p(ids[i] | ids[:i]) for i >= 1, float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_greedy_is_token_exact_with_transformers_and_logprobs_agree(gguf_path, hf, prompts):
    engine = build_engine(EngineConfig(model=str(gguf_path), kv_cache_tokens=4096,
                                       quantization="none", dtype="float32",
                                       kv_cache_dtype="float32"))
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=True)
    for prompt, seq in zip(prompts, engine.generate(prompts, params), strict=True):
        assert seq.output_ids == hf_greedy(hf[0], prompt)
        ref = hf_logprobs(hf[0], prompt + seq.output_ids)[len(prompt) - 1:]
        assert torch.allclose(torch.tensor(seq.logprobs), ref, atol=1e-3), (seq.logprobs, ref)


def _strings(n: int) -> list[str]:
    """Up to 70% ShareGPT prompts and answers (when the data is there), the rest generated:
    unicode from many scripts, emoji, whitespace runs, digits, code."""
    out = []
    if SHAREGPT.is_file():
        for conv in json.loads(SHAREGPT.read_text()):
            out += [turn["value"] for turn in conv["conversations"]][:2]
        out = out[:n * 7 // 10]
    rng = random.Random(0)
    pieces = ["hello", " world", "  ", "\n\n", "\t", " \r\n", "1234", " 56", "3.14", "½", "٣",
              "你好", "こんにちは", "Привет", "مرحبا", "🙂", "🇫🇷", "é", "ß", "<|im_start|>",
              "<|im_end|>", "def f(x):\n    return x", "{'a': [1, 2]}", "'s", "'ll", "—", "\u00a0"]
    while len(out) < n:
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
    return out[:n]


def test_tokenizer_from_gguf_metadata_encodes_as_transformers(gguf_path, hf):
    """transformers' GGUF converter ignores `tokenizer.ggml.pre = smollm` (digits split one by
    one, as llama.cpp and SmolLM2's own tokenizer.json do), so: equal to transformers' tokenizer
    with SmolLM2's pre-tokenizer (Digits + ByteLevel) on every string, and to its unmodified GGUF
    tokenizer on every string without numerals."""
    ours = load_tokenizer(gguf_path)
    plain = hf[1]
    upstream = copy.deepcopy(plain)  # transformers' GGUF tokenizer, its pre-tokenizer changed
    upstream.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    texts = _strings(1000)
    no_numerals = 0
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == upstream(text)["input_ids"], text
        if not regex.search(r"\p{N}", text):
            no_numerals += 1
            assert ids == plain(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert no_numerals > 300


def test_chat_template_renders_as_transformers(gguf_path, hf):
    ours = load_chat_template(gguf_path)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "  c \n"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = hf[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render(messages, add_generation_prompt=gen) == want


@pytest.fixture(scope="module")
def stack(gguf_path):
    s = Stack(gguf_path, "--kv-cache-tokens", "4096", "--quantization", "none",
              "--dtype", "float32", "--kv-cache-dtype", "float32").start(timeout_s=180)
    yield s
    s.stop()


def test_server_answers_paris_as_transformers_does(stack, hf, prompts):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=MAX_NEW,
        messages=[{"role": "user", "content": QUESTIONS[0]}])
    text = reply.choices[0].message.content
    assert "Paris" in text
    want = hf[1].decode(hf_greedy(hf[0], prompts[0]), skip_special_tokens=True)
    assert text == want


def hf_rows(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32: row i is log p(. | ids[:i + 1])."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_top(top: dict, row: torch.Tensor, k: int) -> None:
    """A completions top_logprobs entry (the chosen token, then k alternatives) against
    transformers' row: its k best logprobs are there, to 1e-3."""
    best = row.topk(k).values.tolist()
    values = sorted(top.values(), reverse=True)[: k]
    assert len(top) >= k and max(abs(a - b) for a, b in zip(values, best, strict=True)) < 1e-3


def test_prompt_logprobs_as_lm_eval_asks_for_them(stack, hf, prompts, gguf_path):
    """lm-eval's loglikelihood request: echo, logprobs k, max_tokens 0."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    ids = prompts[4] + prompts[5]
    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=ids, echo=True,
                                  logprobs=5, max_tokens=0, temperature=0)
    choice, rows = r.choices[0], hf_rows(hf[0], ids)
    tok = load_tokenizer(gguf_path)
    assert choice.text == tok.decode(ids, skip_special_tokens=False)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = rows[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-3)
    for i in range(1, len(ids)):
        check_top(lp.top_logprobs[i], rows[i - 1], 5)


def test_streamed_echo_and_top_logprobs_of_generated_tokens(stack, hf, prompts):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    text = COMPLETIONS[2]
    chunks = list(client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=text, echo=True, logprobs=2, max_tokens=6,
        temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith(text)
    tokens, logprobs, tops = [], [], []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            logprobs += c.choices[0].logprobs.token_logprobs
            tops += c.choices[0].logprobs.top_logprobs
    ids = prompts[6]  # the same text, tokenized by the server's tokenizer
    assert len(tokens) == len(ids) + 6 and logprobs[0] is None
    generated = hf_greedy(hf[0], ids)[:6]
    rows = hf_rows(hf[0], ids + generated)
    full = ids + generated
    want = rows[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    assert torch.allclose(torch.tensor(logprobs[1:]), want, atol=1e-3)
    for i in range(1, len(full)):
        check_top(tops[i], rows[i - 1], 2)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text + hf[1].decode(
        generated)


def test_chat_top_logprobs_match_transformers(stack, hf, prompts):
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=8, logprobs=True,
        top_logprobs=3, messages=[{"role": "user", "content": QUESTIONS[0]}])
    content = r.choices[0].logprobs.content
    generated = hf_greedy(hf[0], prompts[0])[:8]
    rows = hf_rows(hf[0], prompts[0] + generated)[len(prompts[0]) - 1 : -1]
    assert len(content) == len(generated)
    for entry, tok, row in zip(content, generated, rows, strict=True):
        assert abs(entry.logprob - row[tok].item()) < 1e-3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-3)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best is the chosen
