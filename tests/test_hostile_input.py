"""Hostile request bodies, unit level: the body walk (depth, surrogates, integer range, NaN),
protocol bounds, the prompt-size cap, admission by count and the tokenizer worker default.
Fast: no processes; the in-process gateway tests use one embedded Redis."""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.json_body import (
    MAX_JSON_DEPTH,
    check_json_value,
    check_prompt_bytes,
    parse_json_body,
)
from pipellm.services.gateway.pending import PendingLimit
from pipellm.services.gateway.protocol import parse_chat, parse_completion
from pipellm.services.gateway.request_fields import MAX_SEED
from pipellm.shared.config import ServiceConfig, auto_tokenizer_workers
from pipellm.shared.messages import ChatMessage
from pipellm.shared.settings import add_config_args


def rejected(raw: bytes | str) -> APIError:
    """parse_json_body(raw) must fail with an OpenAI-style 400."""
    with pytest.raises(APIError) as info:
        parse_json_body(raw.encode() if isinstance(raw, str) else raw)
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error", err
    json.dumps(err.body())  # the error itself is always serialisable (ASCII-escaped)
    return err


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + "1" + close * depth


def test_depth_limit_is_exact_for_arrays_and_objects():
    assert parse_json_body(nested(MAX_JSON_DEPTH).encode()) is not None
    assert "nested deeper than 32" in rejected(nested(MAX_JSON_DEPTH + 1)).message
    deep_obj = '{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1)
    assert rejected(deep_obj).param == "a"  # the top-level key it sits under
    assert parse_json_body(('{"a":' * MAX_JSON_DEPTH + "1" + "}" * MAX_JSON_DEPTH).encode())


@pytest.mark.parametrize("depth", [1000, 100_000, 1_000_000])
def test_deep_nesting_past_the_recursion_limit_is_400_and_fast(depth):
    start = time.perf_counter()
    assert "nested deeper" in rejected(nested(depth)).message
    assert "nested deeper" in rejected('{"prompt": ' + nested(depth, "{\"a\":", "}") + "}").message
    assert time.perf_counter() - start < 2


def test_walk_is_iterative_on_structures_deeper_than_the_stack():
    value: list = []
    for _ in range(100_000):  # built in Python, not parsed: only the walk can reject it
        value = [value]
    with pytest.raises(APIError, match="nested deeper"):
        check_json_value({"prompt": value})


@pytest.mark.parametrize("raw,param", [
    (r'{"prompt": "a\ud800b"}', "prompt"),
    (r'{"prompt": "\udfff"}', "prompt"),
    (r'{"messages": [{"role": "user", "content": "hi \udbff"}]}', "messages"),
    (r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages"),
    (r'{"stop": ["ok", "\ude00"]}', "stop"),
    (r'{"prompt": "x", "user": "\ud83d"}', "user"),  # high surrogate without its low half
    (r'{"\ud800": 1}', None),  # in a key: the key cannot be named
    (r'{"logit_bias": {"\udc00": 1}}', "logit_bias"),
])
def test_lone_surrogates_anywhere_are_rejected(raw, param):
    err = rejected(raw)
    assert "surrogate" in err.message and "rejected, not replaced" in err.message
    assert err.param == param


def test_surrogate_pairs_are_fine():
    assert parse_json_body(rb'{"prompt": "\ud83d\ude00 ok"}') == {"prompt": "\U0001F600 ok"}


@pytest.mark.parametrize("literal", [
    str(2**63), str(-(2**63) - 1), str(2**64), "9" * 20, "9" * 5000, "-" + "9" * 100_000])
def test_integers_outside_int64_are_rejected(literal):
    for raw in (f'{{"max_tokens": {literal}}}', f'{{"prompt": [1, 2, {literal}]}}',
                f'{{"x": [{{"y": "s"}}, {literal}]}}', f'{{"top_k": [{literal}, "a"]}}'):
        err = rejected(raw)
        assert "out of range (signed 64-bit)" in err.message, raw


def test_int64_edges_and_token_arrays_pass():
    body = parse_json_body(f'{{"a": {2**63 - 1}, "b": {-(2**63)}, "c": [0, 1, 2]}}'.encode())
    assert body == {"a": 2**63 - 1, "b": -(2**63), "c": [0, 1, 2]}
    with pytest.raises(APIError, match="out of range"):  # values built in Python, too
        check_json_value({"prompt": [1, 2**64]})
    with pytest.raises(APIError, match="out of range"):
        check_json_value({"n": [True, -(2**70)]})


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_rejected(literal):
    for raw in (f'{{"temperature": {literal}}}', f'{{"a": [1, {{"b": {literal}}}]}}'):
        assert literal.lstrip("-") in rejected(raw).message


@pytest.mark.parametrize("literal", ["1e999", "-1e400", "1" * 400 + ".0"])
def test_floats_that_overflow_are_rejected(literal):
    assert "finite" in rejected(f'{{"top_p": {literal}}}').message


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xff"}', b'{"prompt": "\xc3\x28"}', b'{"prompt": "\xed\xa0\x80"}',
    b'{"prompt": "\xc0\xaf"}', b'{"prompt": "\xe2\x82"}', '{"prompt": "x"}'.encode("utf-16")])
def test_bytes_that_are_not_utf8_are_rejected(raw):
    assert "UTF-8" in rejected(raw).message


@pytest.mark.parametrize("raw", [
    b"", b"{", b'{"prompt": "x"', b'{"prompt": "x"}}', b"\xef\xbb\xbf{}", b"nul\x00",
    b'{"a": 01}', b"[1,]", b"{'a': 1}", '{"prompt": "x"}'.encode("utf-32-le")])
def test_malformed_json_is_rejected(raw):
    assert "not valid JSON" in rejected(raw).message


def test_duplicate_keys_keep_the_last_value():
    assert parse_json_body(b'{"max_tokens": 2, "max_tokens": 3}') == {"max_tokens": 3}
    rejected(b'{"max_tokens": 2, "max_tokens": 99999999999999999999}')


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_parse_or_give_a_400(raw):
    try:
        parse_json_body(raw)
    except APIError as e:
        assert e.status == 400


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
                    max_leaves=30))
def test_any_python_json_value_walks_or_gives_a_400(value):
    try:
        check_json_value({"x": value})
    except APIError as e:
        assert e.status == 400


# -- protocol bounds ---------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("max_tokens", 2**31), ("top_k", 2**31), ("min_tokens", 2**31), ("seed", MAX_SEED + 1),
    ("seed", 2**63 - 1)])
def test_integer_fields_have_upper_bounds(field, value):
    for parse, base in ((parse_completion, {"prompt": "x"}),
                        (parse_chat, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(APIError) as info:
            parse({**base, field: value}, "m")
        assert info.value.status == 400 and info.value.param == field
    with pytest.raises(APIError, match="at most"):
        parse_chat({"messages": [{"role": "user", "content": "x"}],
                    "max_completion_tokens": 2**31}, "m")


def test_largest_seed_leaves_room_for_every_choice():
    req = parse_completion({"prompt": "x", "seed": MAX_SEED, "n": 16}, "m")
    assert req.params.seed + req.n - 1 < 2**63


# -- the prompt-size cap -----------------------------------------------------------------------

def test_prompt_bytes_counts_utf8_bytes_exactly():
    check_prompt_bytes(("a" * 100,), None, 100)
    check_prompt_bytes(("é" * 40, (5, 6), "a" * 20), None, 100)  # 100 bytes, ids not counted
    with pytest.raises(APIError) as info:
        check_prompt_bytes(("é" * 50, "a"), None, 100)  # a batch's texts together
    err = info.value
    assert err.status == 400 and err.param == "prompt" and err.code == "prompt_too_large"
    assert "100 bytes" in err.message and "--max-prompt-bytes" in err.message
    with pytest.raises(APIError):
        check_prompt_bytes(("a" * 10**6,), None, 100)


def test_prompt_bytes_sums_chat_message_contents():
    msgs = (ChatMessage("system", "🌍" * 10), ChatMessage("user", "a" * 60))
    check_prompt_bytes((), msgs, 100)  # 40 + 60
    with pytest.raises(APIError) as info:
        check_prompt_bytes((), msgs, 99)
    assert info.value.param == "messages"


def test_prompt_bytes_limit_default_and_flag():
    assert ServiceConfig().prompt_bytes_limit(2048) == 64 * 1024  # 32 KiB < the 64 KiB floor
    assert ServiceConfig().prompt_bytes_limit(8192) == 16 * 8192
    assert ServiceConfig(max_prompt_bytes=1000).prompt_bytes_limit(8192) == 1000
    with pytest.raises(ValueError, match="max-prompt-bytes"):
        ServiceConfig(max_prompt_bytes=-1)


# -- admission by count, tokenizer workers, flags ----------------------------------------------

def test_pending_limit_counts_holds_and_releases_on_error():
    limit = PendingLimit(2)
    with limit.hold(), limit.hold():
        assert len(limit) == 2
        with pytest.raises(APIError) as info, limit.hold():
            pass
        assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
        assert len(limit) == 2
    with pytest.raises(RuntimeError), limit.hold():
        raise RuntimeError
    assert len(limit) == 0


@pytest.mark.parametrize("cores,workers", [(1, 1), (2, 1), (3, 1), (4, 2), (64, 2)])
def test_tokenizer_workers_default_by_cores(cores, workers):
    assert auto_tokenizer_workers(cores) == workers


def test_tokenizer_workers_by_cores_unless_the_flag_says():
    assert ServiceConfig().tokenizers == auto_tokenizer_workers() >= 1
    assert ServiceConfig(tokenizer_workers=3).tokenizers == 3
    with pytest.raises(ValueError, match="tokenizer-workers"):
        ServiceConfig(tokenizer_workers=-1)


def test_new_flags_parse_and_have_help():
    parser = argparse.ArgumentParser()
    add_config_args(parser, ServiceConfig)
    args = parser.parse_args(["--max-prompt-bytes", "4096", "--tokenizer-workers", "3"])
    assert (args.max_prompt_bytes, args.tokenizer_workers) == (4096, 3)
    text = " ".join(parser.format_help().split())
    assert "--max-prompt-bytes N largest prompt" in text
    assert "2 with 4 or more cores" in text


def test_completions_keep_16_chat_goes_to_the_context():
    """max_tokens_auto (fill the context) is asked for chat without max_tokens only."""
    from pipellm.services.gateway.app import Gateway

    gw = SimpleNamespace(svc=SimpleNamespace(addr=lambda name: "ipc://x"), seeds=None)
    inflight = SimpleNamespace(arrival=0.0)
    def make(*args):
        (one,) = Gateway._tokenize_requests(*args)
        return one

    chat = [{"role": "user", "content": "x"}]
    assert make(gw, "a", parse_completion({"prompt": "x"}, "m"), inflight).params.max_tokens == 16
    assert not make(gw, "a", parse_completion({"prompt": "x"}, "m"), inflight).max_tokens_auto
    assert make(gw, "a", parse_chat({"messages": chat}, "m"), inflight).max_tokens_auto
    assert not make(gw, "a", parse_chat({"messages": chat, "max_tokens": 5}, "m"),
                    inflight).max_tokens_auto


def test_gateway_redis_pool_has_a_connection_per_pending_request_and_blocks():
    import redis.asyncio as aioredis

    from pipellm.services.gateway.service import redis_client

    pool = redis_client(ServiceConfig(redis_url="redis://127.0.0.1:1/0", max_pending=8))
    pool = pool.connection_pool
    assert isinstance(pool, aioredis.BlockingConnectionPool) and pool.max_connections == 8 + 32
