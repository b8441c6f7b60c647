"""Tests for pipellm.services.gateway: request validation, OpenAI-shaped responses/chunks,
errors."""

from __future__ import annotations

import json
import re
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion, completion_create_params
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat import completion_create_params as chat_create_params

from pipellm.services.gateway import errors
from pipellm.services.gateway.chat_settings import ChatSettings
from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.protocol import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from pipellm.services.gateway.responses import (
    SSE_DONE,
    Choice,
    TokenLogprob,
    Usage,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    new_id,
    sse,
    usage_chunk,
)
from pipellm.shared.generation_config import GenerationDefaults
from pipellm.shared.messages import ChatMessage
from pipellm.shared.sampling import SamplingParams

M = "demo"
MSG = [{"role": "user", "content": "hi"}]
PARSE = {"completion": parse_completion, "chat": parse_chat}
BASE = {"completion": {"model": M, "prompt": "hi"}, "chat": {"model": M, "messages": MSG}}


def fail(kind: str, body, status=400) -> APIError:
    """The 400 a strict server (--strict-request-fields) answers `body` with."""
    with pytest.raises(APIError) as info:
        PARSE[kind](body, M, strict=True)
    assert info.value.status == status
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    return info.value


# (extra fields on top of the base body, param, message substring) -- for both endpoints
COMMON_ERRORS = [
    ({"model": 5}, "model", "must be a string"),
    ({"foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
    ({"skip_special_tokens": 0}, "skip_special_tokens", "must be a boolean"),
    ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens",
     "is not supported"),
    ({"return_hidden_states": True}, "return_hidden_states", "is not supported"),
    ({"guided_json": []}, "guided_json", "must be a JSON schema object"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "Unrecognized request argument"),
    ({"max_tokens": "16"}, "max_tokens", "max_tokens must be an integer"),
    ({"max_tokens": True}, "max_tokens", "must be an integer"),
    ({"max_tokens": 16.0}, "max_tokens", "must be an integer"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens must be"),
    ({"temperature": "0.5"}, "temperature", "temperature must be a number"),
    ({"temperature": True}, "temperature", "must be a number"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"temperature": 10**400}, "temperature", "finite"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"top_p": 1.5}, "top_p", "top_p"),
    ({"top_k": -2}, "top_k", "top_k"),
    ({"top_k": 1.5}, "top_k", "must be an integer"),
    ({"min_p": 2}, "min_p", "min_p"),
    ({"seed": -1}, "seed", "seed"),
    ({"seed": 2**63}, "seed", "seed"),
    ({"seed": "1"}, "seed", "must be an integer"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos", "must be a boolean"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "token id"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids", "token id"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids", "token id"),
    ({"stop_token_ids": 5}, "stop_token_ids", "array of token ids"),
    ({"stop": ""}, "stop", "must not be empty"),
    ({"stop": ["a", ""]}, "stop", "must not be empty"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"stop": [1]}, "stop", "string"),
    ({"stop": 5}, "stop", "string"),
    ({"n": 0}, "n", "between 1 and 16"),
    ({"n": 17}, "n", "between 1 and 16"),
    ({"n": True}, "n", "must be an integer"),
    ({"stream": "true"}, "stream", "must be a boolean"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"stream": False, "stream_options": {}}, "stream_options", "only allowed when stream"),
    ({"stream": True, "stream_options": []}, "stream_options", "must be an object"),
    ({"stream": True, "stream_options": {"continuous_usage": True}}, "stream_options",
     "Unrecognized"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage", "boolean"),
    ({"user": 5}, "user", "must be a string"),
    ({"logit_bias": {"a": 5}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"-1": 5}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"9" * 5000: 5}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"1": "5"}}, "logit_bias", "must be a number"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": [1]}, "logit_bias", "must be an object"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
]

COMPLETION_ERRORS = [
    ({"prompt": None}, "prompt", "prompt is required"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": [[]]}, "prompt[0]", "must not be empty"),
    ({"prompt": [""]}, "prompt[0]", "must not be empty"),
    ({"prompt": ["a", [2, "b"]]}, "prompt[1]", "token id"),
    ({"prompt": [1, "a"]}, "prompt", "token id"),
    ({"prompt": [-1]}, "prompt", "token id"),
    ({"prompt": [True]}, "prompt[0]", "must be a string"),
    ({"prompt": 5}, "prompt", "must be a string"),
    ({"prompt": {"a": 1}}, "prompt", "must be a string"),
    ({"logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"logprobs": -1}, "logprobs", "between 0 and 20"),
    ({"logprobs": True}, "logprobs", "must be an integer"),
    ({"echo": 0}, "echo", "must be a boolean"),
    ({"echo": "yes"}, "echo", "must be a boolean"),
    ({"suffix": "x"}, "suffix", "`suffix` is not supported"),
    ({"best_of": 2, "n": 3}, "best_of", "must be at least n"),
    ({"best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
    ({"best_of": 17}, "best_of", "between 1 and 16"),
    ({"best_of": "1"}, "best_of", "must be an integer"),
    ({"max_completion_tokens": 5}, "max_completion_tokens", "Unrecognized"),
    ({"messages": MSG}, "messages", "Unrecognized"),
    ({"top_logprobs": 0}, "top_logprobs", "Unrecognized"),
]

CHAT_ERRORS = [
    ({"messages": None}, "messages", "messages is required"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": "hi"}, "messages", "must be an array"),
    ({"messages": [5]}, "messages[0]", "must be an object"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing `role`"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ({"messages": MSG + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id",
     "is required in tool messages"),
    ({"messages": MSG + [{"role": "function", "content": "x"}]}, "messages[1].role",
     "`function` messages are not supported"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "unknown role"),
    ({"messages": [{"role": 3, "content": "x"}]}, "messages[0].role", "unknown role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages[0].content[0]", "`image_url` is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0]", '"type": "text"'),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]", "`type`"),
    ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo",
     "Unrecognized"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0]", "must be"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls", "belong to assistant messages"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", "string"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "between 0 and 20"),
    ({"top_logprobs": -1}, "top_logprobs", "between 0 and 20"),
    ({"logprobs": 1}, "logprobs", "must be a boolean"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "differ"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     '"auto" tool choice is off'),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"response_format": {"type": "json"}}, "response_format.type", "must be 'text'"),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls", "boolean"),
    ({"service_tier": "flex"}, "service_tier", "not supported"),
    ({"metadata": {"a": "b"}}, "metadata", "not supported"),  # labels a stored completion
    ({"prompt_cache_key": 5}, "prompt_cache_key", "string"),
    ({"safety_identifier": ["u"]}, "safety_identifier", "string"),
    ({"store": True}, "store", "not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "not supported"),
    ({"prompt": "x"}, "prompt", "Unrecognized"),
    ({"best_of": 1}, "best_of", "Unrecognized"),
]

ERROR_CASES = ([(k, *c) for k in PARSE for c in COMMON_ERRORS]
               + [("completion", *c) for c in COMPLETION_ERRORS]
               + [("chat", *c) for c in CHAT_ERRORS])


@pytest.mark.parametrize(("kind", "extra", "param", "text"), ERROR_CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_invalid_requests(kind, extra, param, text):
    err = fail(kind, {**BASE[kind], **extra})
    assert err.param == param
    assert text in err.message
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                    "param": param, "code": None}}
    if text.startswith("Unrecognized") and param != "stream_options":  # served by default
        assert PARSE[kind]({**BASE[kind], **extra}, M).ignored == (param,)
    else:
        with pytest.raises(APIError, match=re.escape(err.message)):
            PARSE[kind]({**BASE[kind], **extra}, M)


@pytest.mark.parametrize("kind", PARSE)
def test_a_client_request_id_names_the_request_and_priority_is_accepted(kind):
    req = PARSE[kind]({**BASE[kind], "request_id": "trace-7.a", "priority": -3}, M)
    assert req.request_id == "trace-7.a"
    assert req.tokenize_requests("r", "to", 0, 0.0)[0].priority == -3  # on to compute
    assert new_id(req.kind, req.request_id) == (
        "chatcmpl-trace-7.a" if kind == "chat" else "cmpl-trace-7.a")
    for bad in ("", "has space", "x" * 129, "naïve", 5, "a:0"):
        with pytest.raises(APIError) as info:
            PARSE[kind]({**BASE[kind], "request_id": bad}, M)
        assert info.value.param == "request_id"
    with pytest.raises(APIError, match="priority"):
        PARSE[kind]({**BASE[kind], "priority": "high"}, M)


@pytest.mark.parametrize("kind", PARSE)
@pytest.mark.parametrize("body", [[], "x", None, 3, [{"prompt": "x"}]])
def test_body_must_be_object(kind, body):
    err = fail(kind, body)
    assert "JSON object" in err.message and err.param is None


@pytest.mark.parametrize("kind", PARSE)
def test_unknown_model_is_404(kind):
    err = fail(kind, {**BASE[kind], "model": "gpt-4"}, status=404)
    assert err.body()["error"] == {"message": "The model `gpt-4` does not exist.",
                                   "type": "invalid_request_error", "param": "model",
                                   "code": "model_not_found"}


SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 1234,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "min_tokens": 3, "ignore_eos": True, "stop_token_ids": [7, 9], "n": 2,
            "stop": ["\n\n", "END"], "stream": True, "user": "u1",
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
EXPECTED = SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                          seed=1234, presence_penalty=0.5, frequency_penalty=-0.5,
                          repetition_penalty=1.1, min_tokens=3, ignore_eos=True,
                          stop_token_ids=(7, 9), logprobs=True)


def check_common(req: GenerationRequest, kind: str):
    assert req.kind == kind and req.model == M and req.params == EXPECTED
    assert (req.stop, req.n, req.stream, req.include_usage) == (("\n\n", "END"), 2, True, True)
    assert req.logprobs and req.user == "u1" and req.max_tokens_given


def test_completion_all_fields():
    req = parse_completion({**BASE["completion"], **SAMPLING, "max_tokens": 50, "logprobs": 0,
                            "best_of": 2, "echo": False, "suffix": None, "logit_bias": {}}, M)
    check_common(req, "completion")
    assert (req.prompts, req.messages, req.num_prompts) == (("hi",), None, 1)
    assert not req.add_generation_prompt and req.best_of == 0 and req.generated == 2


def test_best_of_and_logit_bias():
    req = parse_completion({**BASE["completion"], "best_of": 5, "n": 2,
                            "logit_bias": {"7": -100, "12": 3.5}}, M)
    assert (req.n, req.best_of, req.generated) == (2, 5, 5)
    assert req.params.logit_bias == ((7, -100.0), (12, 3.5))
    chat = parse_chat({**BASE["chat"], "logit_bias": {"0": 1}}, M)
    assert chat.params.logit_bias == ((0, 1.0),) and chat.generated == 1


def test_chat_all_fields():
    messages = [{"role": "system", "content": "be brief", "name": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                ChatCompletionMessage(role="assistant", content="ok").model_dump(),
                {"role": "user", "content": ""}]
    req = parse_chat({"messages": messages, **SAMPLING, "max_completion_tokens": 50,
                      "max_tokens": 50, "logprobs": True, "top_logprobs": 0,
                      "add_generation_prompt": False, "tools": [], "tool_choice": "none",
                      "response_format": {"type": "text"}, "store": False, "metadata": {},
                      "service_tier": "auto", "modalities": ["text"],
                      "parallel_tool_calls": None, "prompt_cache_key": "conv-1",
                      "safety_identifier": "user-hash"}, M)
    check_common(req, "chat")
    assert req.messages == (ChatMessage("system", "be brief", name="sys"),
                            ChatMessage("user", "a\nb"), ChatMessage("assistant", "ok"),
                            ChatMessage("user", ""))
    assert req.prompts == () and req.num_prompts == 1 and not req.add_generation_prompt


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("x", ("x",)), (["x"], ("x",)), ([1, 2, 3], ((1, 2, 3),)), ([[4, 5]], ((4, 5),)),
    ([0], ((0,),)), (["a", [7, 8], "b"], ("a", (7, 8), "b"))])
def test_prompt_shapes(prompt, prompts):
    req = parse_completion({"prompt": prompt}, M)
    assert req.prompts == prompts and req.num_prompts == len(prompts)


def test_a_batch_becomes_one_tokenize_request_per_prompt():
    req = parse_completion({"prompt": ["a", [7, 8]], "n": 2, "seed": 3}, M)
    first, second = req.tokenize_requests("cmpl-1", "gw", 9, 0.0)
    assert (first.prompt_text, first.prompt_ids, first.prompt_index) == ("a", None, 0)
    assert (second.prompt_text, list(second.prompt_ids), second.prompt_index) == (None, [7, 8], 1)
    assert first.num_prompts == second.num_prompts == 2 and first.n == second.n == 2
    assert first.params.seed == second.params.seed == 3
    for bad, param in ((["a", ""], "prompt[1]"), (["a", 5], "prompt[1]"),
                       (["a"] * 1025, "prompt")):
        with pytest.raises(APIError) as info:
            parse_completion({"prompt": bad}, M)
        assert info.value.param == param


@pytest.mark.parametrize("kind", PARSE)
def test_defaults_and_nulls(kind):
    nulls = {k: None for k in SAMPLING} | {"model": None, "max_tokens": None, "logprobs": None}
    for body in ({k: v for k, v in BASE[kind].items() if k != "model"}, {**BASE[kind], **nulls}):
        req = PARSE[kind](body, M, defaults=GenerationDefaults(max_tokens=123))
        assert req.model == M and req.params == SamplingParams(max_tokens=123)
        assert not req.max_tokens_given and req.stop == () and req.n == 1
        assert not (req.stream or req.include_usage or req.logprobs) and req.user is None
        assert req.add_generation_prompt == (kind == "chat")
    # without a model default: completions 16, chat up to the context (the tokenizer lowers it)
    assert PARSE[kind](BASE[kind], M).params.max_tokens == (16 if kind == "completion"
                                                            else None)


def test_logprobs_echo_and_max_tokens_zero():
    req = parse_completion({"prompt": "x", "logprobs": 5}, M)
    assert (req.params.logprobs, req.params.top_logprobs, req.params.prompt_logprobs) == (
        True, 5, None)
    assert req.logprobs and req.params.top_logprobs == 5 and not req.echo
    # lm-eval's loglikelihood request: the prompt's logprobs, nothing generated
    req = parse_completion({"prompt": "x", "echo": True, "logprobs": 3, "max_tokens": 0}, M)
    assert req.echo and req.discard_output and req.max_tokens_given
    assert (req.params.max_tokens, req.params.prompt_logprobs, req.params.top_logprobs) == (
        1, 3, 3)
    req = parse_completion({"prompt": "x", "echo": True}, M)  # echo alone: text, no logprobs
    assert req.echo and req.params.prompt_logprobs is None and not req.discard_output
    req = parse_chat({"messages": MSG, "logprobs": True, "top_logprobs": 20}, M)
    assert req.params.top_logprobs == 20 and req.params.prompt_logprobs is None


def test_small_accepted_variants():
    assert parse_completion({"prompt": "x", "logprobs": 0}, M).params.logprobs
    assert parse_completion({"prompt": "x", "top_k": -1}, M).params.top_k == -1
    assert parse_completion({"prompt": "x", "stop": "##"}, M).stop == ("##",)
    assert parse_completion({"prompt": "x", "stop": []}, M).stop == ()
    assert parse_completion({"prompt": "x", "temperature": 0}, M).params.greedy
    assert parse_chat({"messages": MSG, "max_tokens": 7}, M).params.max_tokens == 7
    req = parse_chat({"messages": MSG, "stream": True, "stream_options": {}}, M)
    assert req.stream and not req.include_usage


# what vllm-router 0.1.17 and sglang-router 0.3.2 add to the bodies they forward (observed)
ROUTER_EXTRAS = {
    "completion": {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                   "return_hidden_states": False, "echo": False},
    "chat": {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
             "return_hidden_states": False, "continue_final_message": False,
             "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True,
             "add_generation_prompt": True, "logprobs": False}}


@pytest.mark.parametrize("kind", PARSE)
def test_router_extras_are_accepted(kind):
    """A body a router forwarded parses as the body the client sent; so does one with
    spaces_between_special_tokens either way (a slow tokenizer's option: ours are fast)."""
    body = {**BASE[kind], "max_tokens": 5, "temperature": 0.5}
    assert PARSE[kind]({**body, **ROUTER_EXTRAS[kind]}, M) == PARSE[kind](body, M)
    for spaces in (True, False):
        assert PARSE[kind]({**body, "spaces_between_special_tokens": spaces}, M) == \
            PARSE[kind](body, M)


@pytest.mark.parametrize(("kind", "schema"), [
    ("completion", completion_create_params.CompletionCreateParamsBase),
    ("chat", chat_create_params.CompletionCreateParamsBase)])
def test_every_openai_field_is_known(kind, schema):
    """Each field of the official client's request schema is handled: supported, or refused
    with "not supported"/a type error, but never "unrecognized"."""
    keys = set(typing.get_type_hints(schema)) | {"stream"}
    assert keys <= (COMPLETION_KEYS if kind == "completion" else CHAT_KEYS)
    for key in keys - {"model", "prompt", "messages"}:
        with pytest.raises(APIError) as info:
            PARSE[kind]({**BASE[kind], key: {"weird": [1]}}, M)
        assert "nrecognized" not in info.value.message
        assert info.value.param.split(".")[0] == key  # the field, or a path inside it


def test_error_helpers():
    cases = [(errors.bad_request("m", "p", "c"), 400, "invalid_request_error", "c"),
             (errors.not_found("m"), 404, "invalid_request_error", None),
             (errors.payload_too_large(), 413, "invalid_request_error", None),
             (errors.too_many_requests(), 429, "invalid_request_error", "rate_limit_exceeded"),
             (errors.unavailable(), 503, "service_unavailable", None),
             (APIError(500, "boom"), 500, "server_error", None)]
    for err, status, type_, code in cases:
        assert (err.status, err.type, err.code) == (status, type_, code)
        assert set(err.body()["error"]) == {"message", "type", "param", "code"}
        assert err.body()["error"]["message"] == err.message == str(err)
    assert errors.bad_request("m", "p").body()["error"]["param"] == "p"


# ---------------------------------------------------------------------------- responses

def test_completion_response_validates():
    entries = [TokenLogprob("Hello", -0.5),
               TokenLogprob(" world", float("-inf"), [(" there", -0.1), (" world", -9e9)])]
    choices = [Choice(0, "Hello world", "stop", entries), Choice(1, "Hi", "length")]
    out = completion_response("cmpl-1", M, 1700000000, choices, Usage(4, 3))
    json.loads(sse(out)[6:])  # strict JSON (no -Infinity)
    c = Completion.model_validate(out)
    assert (c.id, c.object, c.created, c.model) == ("cmpl-1", "text_completion", 1700000000, M)
    assert [(x.index, x.text, x.finish_reason) for x in c.choices] == [
        (0, "Hello world", "stop"), (1, "Hi", "length")]
    lp = c.choices[0].logprobs
    assert lp.tokens == ["Hello", " world"] and lp.token_logprobs == [-0.5, -9999.0]
    assert lp.text_offset == [0, 5]
    # the chosen token first, then the alternatives (vLLM's shape); a repeat keeps its place
    assert lp.top_logprobs == [{"Hello": -0.5}, {" world": -9e9, " there": -0.1}]
    assert list(lp.top_logprobs[1]) == [" world", " there"]
    assert c.choices[1].logprobs is None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (4, 3, 7)


def test_echoed_prompt_logprobs_start_with_null():
    """As OpenAI's legacy API and vLLM answer (the client's pydantic type cannot say so)."""
    lp = completion_logprobs([TokenLogprob("A", None), TokenLogprob("B", -1.5, [("C", -0.2)])])
    assert lp == {"tokens": ["A", "B"], "token_logprobs": [None, -1.5],
                  "top_logprobs": [None, {"B": -1.5, "C": -0.2}], "text_offset": [0, 1]}


def test_chat_response_validates():
    choices = [Choice(0, "héllo", "stop", [TokenLogprob("h", -0.25, [("h", -0.25), ("x", -2.0)]),
                                          TokenLogprob("éllo", -1.0)])]
    c = ChatCompletion.model_validate(chat_response("chatcmpl-9", M, 5, choices, Usage(2, 2)))
    assert (c.id, c.object, c.created, c.model) == ("chatcmpl-9", "chat.completion", 5, M)
    ch = c.choices[0]
    assert (ch.index, ch.finish_reason, ch.message.role, ch.message.content) == (
        0, "stop", "assistant", "héllo")
    assert [(t.token, t.logprob) for t in ch.logprobs.content] == [("h", -0.25), ("éllo", -1.0)]
    assert [(t.token, t.logprob, t.bytes) for t in ch.logprobs.content[0].top_logprobs] == [
        ("h", -0.25, [104]), ("x", -2.0, [120])]
    assert ch.logprobs.content[1].top_logprobs == []
    assert c.usage.total_tokens == 4


def test_chat_stream_chunks_validate():
    lp = chat_logprobs([TokenLogprob("é", -0.1)])
    chunks = [chat_chunk("chatcmpl-2", M, 9, 0, "", "assistant", None, None, include_usage=True),
              chat_chunk("chatcmpl-2", M, 9, 0, "é", None, None, lp, include_usage=True),
              chat_chunk("chatcmpl-2", M, 9, 0, None, None, "length", None, include_usage=True),
              usage_chunk("chat", "chatcmpl-2", M, 9, Usage(3, 1))]
    parsed = [ChatCompletionChunk.model_validate(json.loads(sse(c)[6:])) for c in chunks]
    assert all(p.object == "chat.completion.chunk" and p.id == "chatcmpl-2" for p in parsed)
    assert [c["usage"] for c in chunks[:3]] == [None] * 3
    assert parsed[0].choices[0].delta.role == "assistant"
    assert parsed[1].choices[0].delta.content == "é" and parsed[1].choices[0].delta.role is None
    assert parsed[1].choices[0].logprobs.content[0].bytes == [0xC3, 0xA9]
    assert chunks[2]["choices"][0]["delta"] == {} and parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].choices == [] and parsed[3].usage.total_tokens == 4
    assert "usage" not in chat_chunk("c", M, 9, 0, "x", None, None, None)


def test_completion_stream_chunks_validate():
    lp = completion_logprobs([TokenLogprob(" b", -0.3)], text_offset=2)
    mid = completion_chunk("cmpl-3", M, 1, 1, " b", None, lp, include_usage=True)
    last = completion_chunk("cmpl-3", M, 1, 1, "", "stop", None)
    # the client's Completion type requires a finish_reason; OpenAI streams null mid-stream
    assert mid["choices"][0]["finish_reason"] is None and mid["usage"] is None
    patched = {**mid, "choices": [{**mid["choices"][0], "finish_reason": "stop"}]}
    m = Completion.model_validate(patched)
    assert (m.object, m.choices[0].index, m.choices[0].text) == ("text_completion", 1, " b")
    assert m.choices[0].logprobs.text_offset == [2] and m.choices[0].logprobs.tokens == [" b"]
    assert Completion.model_validate(last).choices[0].finish_reason == "stop"
    assert "usage" not in last
    u = Completion.model_validate(usage_chunk("completion", "cmpl-3", M, 1, Usage(1, 2)))
    assert u.choices == [] and u.usage.total_tokens == 3 and u.object == "text_completion"


def test_sse_framing_and_ids():
    event = sse({"a": "ü"})
    assert event == 'data: {"a":"ü"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        sse({"x": float("nan")})
    assert new_id("chat").startswith("chatcmpl-") and new_id("completion").startswith("cmpl-")
    assert new_id("chat") != new_id("chat")


# ---------------------------------------------------------------------------- fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["user", "assistant", "text", "", "none", "auto"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "include_usage"]) | st.text(max_size=4),
        inner, max_size=4),
    max_leaves=12)


def parse_or_api_error(kind: str, body) -> None:
    try:
        req = PARSE[kind](body, M)
    except APIError as err:
        assert 400 <= err.status < 500 and json.dumps(err.body())
        return
    assert isinstance(req.params, SamplingParams) and 1 <= req.n <= 16
    assert (len(req.prompts) >= 1) == (kind == "completion")


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(list(PARSE)), body=json_values)
def test_fuzz_any_body(kind, body):
    parse_or_api_error(kind, body)


@settings(max_examples=250, deadline=None)
@given(kind=st.sampled_from(list(PARSE)), data=st.data())
def test_fuzz_known_keys(kind, data):
    keys = sorted(COMPLETION_KEYS if kind == "completion" else CHAT_KEYS)
    extra = data.draw(st.dictionaries(st.sampled_from(keys), json_values, max_size=4))
    parse_or_api_error(kind, {**BASE[kind], **extra})


def test_prompt_making_fields_reach_the_tokenizer():
    chat = parse_chat({**BASE["chat"], "chat_template_kwargs": {"enable_thinking": False},
                       "continue_final_message": True, "truncate_prompt_tokens": 5,
                       "truncation_side": "right"}, M)
    (one,) = chat.tokenize_requests("c", "gw", 1, 0.0)
    assert json.loads(one.chat_template_kwargs) == {"enable_thinking": False}
    assert one.continue_final_message and not one.add_generation_prompt
    assert (one.truncate_prompt_tokens, one.truncation_side) == (5, "right")
    (plain,) = parse_completion({**BASE["completion"], "truncate_prompt_tokens": -1}, M
                                ).tokenize_requests("c", "gw", 1, 0.0)
    assert (plain.truncate_prompt_tokens, plain.truncation_side) == (-1, "left")
    # add_special_tokens: a text prompt's default yes, a chat's no (vLLM's defaults)
    assert plain.add_special_tokens and not one.add_special_tokens and not one.chat_template
    (bare,) = parse_completion({**BASE["completion"], "add_special_tokens": False}, M
                               ).tokenize_requests("c", "gw", 1, 0.0)
    assert bare.add_special_tokens is False
    # vLLM's documents: the template's `documents` variable (chat_template_kwargs win)
    docs = [{"title": "a", "text": "b"}]
    (rag,) = parse_chat({**BASE["chat"], "documents": docs}, M).tokenize_requests(
        "c", "gw", 1, 0.0)
    assert json.loads(rag.chat_template_kwargs) == {"documents": docs}
    # a request's own chat template: only where the server trusts them
    own = {**BASE["chat"], "chat_template": "{{ messages[0].content }}"}
    assert "--trust-request-chat-template" in fail("chat", own).message
    trusting = ChatSettings(trust_request_template=True)
    (mine,) = parse_chat(own, M, chat=trusting).tokenize_requests("c", "gw", 1, 0.0)
    assert mine.chat_template == "{{ messages[0].content }}"
    for kind, extra, param in [
            ("chat", {"documents": "a"}, "documents"),
            ("chat", {"documents": ["a"]}, "documents"),
            ("chat", {"add_special_tokens": 1}, "add_special_tokens"),
            ("completion", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
            ("completion", {"logprob_token_ids": [1]}, "logprob_token_ids"),
            ("chat", {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
            ("chat", {"return_token_offsets": True}, "return_token_offsets"),
            ("chat", {"continue_final_message": True, "add_generation_prompt": True},
             "continue_final_message"),
            ("chat", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
            ("completion", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
            ("completion", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
            ("completion", {"truncation_side": "middle"}, "truncation_side")]:
        assert fail(kind, {**BASE[kind], **extra}).param == param


@pytest.mark.parametrize("kind", PARSE)
def test_continuous_usage_stats_needs_include_usage(kind):
    options = {"include_usage": True, "continuous_usage_stats": True}
    req = PARSE[kind]({**BASE[kind], "stream": True, "stream_options": options}, M)
    assert req.include_usage and req.continuous_usage
    req = PARSE[kind]({**BASE[kind], "stream": True,
                       "stream_options": {"continuous_usage_stats": True}}, M)
    assert not req.continuous_usage
