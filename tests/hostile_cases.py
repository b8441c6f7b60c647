"""Hostile HTTP requests for the gateway: one hand-written example per class (HOSTILE) and a
seeded generator of mutations of valid bodies (`generate`), shared by the in-process gateway
tests and the end-to-end corpus test.

A case is (class name, path, content type or None, body bytes). Every case must be answered
below 500; most are 4xx, a few mutations happen to stay valid and are served (200).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = "application/json"
Case = tuple[str, str, str | None, bytes]

# One of each class; the expected answer is a 4xx for all of them.
HOSTILE: list[Case] = [
    ("deep_nesting", COMPLETIONS, JSON, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("deep_nesting", CHAT, JSON, b'{"messages": ' + b'{"a":' * 40 + b"1" + b"}" * 41),
    ("surrogate", COMPLETIONS, JSON, rb'{"prompt": "hi \ud800"}'),
    ("surrogate", CHAT, JSON, rb'{"messages": [{"role": "user", "content": "\udfff"}]}'),
    ("surrogate", COMPLETIONS, JSON, rb'{"prompt": "x", "stop": ["\ud800"]}'),
    ("surrogate", COMPLETIONS, JSON, rb'{"prompt": "x", "\ud800": 1}'),
    ("huge_int", COMPLETIONS, JSON, b'{"prompt": "x", "max_tokens": 18446744073709551616}'),
    ("huge_int", COMPLETIONS, JSON, b'{"prompt": "x", "top_k": 18446744073709551616}'),
    ("huge_int", COMPLETIONS, JSON, b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
    ("huge_int", CHAT, JSON, b'{"messages": [], "n": -9223372036854775809}'),
    ("huge_int", COMPLETIONS, JSON, b'{"prompt": "x", "max_tokens": 2147483648}'),
    ("nan", COMPLETIONS, JSON, b'{"prompt": "x", "temperature": NaN}'),
    ("nan", COMPLETIONS, JSON, b'{"prompt": "x", "top_p": Infinity}'),
    ("nan", CHAT, JSON, b'{"messages": [{"role": "user", "content": "x"}], "min_p": -Infinity}'),
    ("huge_float", COMPLETIONS, JSON, b'{"prompt": "x", "temperature": 1e999}'),
    ("invalid_utf8", COMPLETIONS, JSON, b'{"prompt": "\xff\xfe"}'),
    ("invalid_utf8", CHAT, JSON, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
    ("truncated", COMPLETIONS, JSON, b'{"prompt": "x", "max_tok'),
    ("wrong_type", COMPLETIONS, JSON, b'{"prompt": {"a": [1, 2]}}'),
    ("wrong_type", CHAT, JSON, b'{"messages": [{"role": "user", "content": 5}]}'),
    ("duplicate_keys", COMPLETIONS, JSON, b'{"prompt": "x", "prompt": 5}'),
    ("wrong_content_type", COMPLETIONS, "text/plain", b"prompt=hello"),
    ("wrong_content_type", CHAT, "application/x-www-form-urlencoded", b"messages=hi"),
    ("junk", CHAT, None, bytes(range(256))),
]

_LONE = ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"]
_BAD_UTF8 = [b"\xff", b"\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82", b"\x80",
             b"\xf5\x80\x80\x80", b"\xf0\x28\x8c\xbc"]
_BIG_INTS = [2**63, 2**64, -(2**63) - 1, 10**30, 2**31, -(2**31)]
_CONSTANTS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"]
_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "min_tokens",
           "logprobs", "stream", "min_p", "presence_penalty", "ignore_eos", "user", "model"]
_ODD_VALUES = [None, True, False, 0, -1, 1.5, "", "x", [], [1], {}, {"a": 1}, [[[]]], "16",
               [None], {"type": "text"}, 2**40]
_CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  "application/octet-stream", "application/json; charset=latin-1", None, ""]


def _base(rng: random.Random) -> tuple[str, dict]:
    """A valid body that costs the engine little (max_tokens <= 4)."""
    common = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.3:
        common["stream"] = True
    if rng.random() < 0.2:
        common["stop"] = ["\n", "the"]
    if rng.random() < 0.5:
        return COMPLETIONS, {"prompt": rng.choice(["Hello", "Once upon a", "1 2 3"]), **common}
    content = rng.choice(["Hi", "What is 2+2?", [{"type": "text", "text": "hey"}]])
    return CHAT, {"messages": [{"role": "user", "content": content}], **common}


def _paths(body) -> list[tuple]:
    """Every (container, key) in body, for replacing one value in place."""
    out, stack = [], [body]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            out.append((node, k))
            if isinstance(v, dict | list):
                stack.append(v)
    return out


def _set_random(rng: random.Random, body: dict, value) -> None:
    node, key = rng.choice(_paths(body))
    node[key] = value


def _nest(rng, body):
    depth = rng.choice([33, 40, 200, 999, 1001, 5000, 50_000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    deep = opener * depth + rng.choice(['"x"', "1", "null"]) + closer * depth
    if rng.random() < 0.3:
        return deep.encode()
    _set_random(rng, body, "@@HOLE@@")  # somewhere inside the body, at any level
    return json.dumps(body).replace('"@@HOLE@@"', deep).encode()


def _surrogate(rng, body):
    lone = rng.choice(_LONE)
    if rng.random() < 0.2:
        body[f"k{lone}"] = 1
    else:
        node, key = rng.choice(_paths(body))
        value = node[key]
        node[key] = (value + lone) if isinstance(value, str) else lone
    return json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \\uXXXX escape


def _huge_int(rng, body):
    if rng.random() < 0.3:
        text = json.dumps({**body, "seed": 0}).replace('"seed": 0', '"seed": ' + "9" * 5000)
        return text.encode()
    if rng.random() < 0.5:
        body[rng.choice(_FIELDS)] = rng.choice(_BIG_INTS)
    else:
        _set_random(rng, body, rng.choice(_BIG_INTS))
    return json.dumps(body).encode()


def _nan(rng, body):
    body[rng.choice(_FIELDS)] = "@@C@@"
    return json.dumps(body).replace('"@@C@@"', rng.choice(_CONSTANTS)).encode()


def _wrong_type(rng, body):
    if rng.random() < 0.5:
        body[rng.choice(_FIELDS + ["prompt", "messages"])] = rng.choice(_ODD_VALUES)
    else:
        _set_random(rng, body, rng.choice(_ODD_VALUES))
    return json.dumps(body).encode()


def _invalid_utf8(rng, body):
    raw = json.dumps(body).encode()
    at = rng.randrange(len(raw))
    return raw[:at] + rng.choice(_BAD_UTF8) + raw[at:]


def _duplicate_keys(rng, body):
    key = rng.choice(list(body))
    extra = json.dumps(rng.choice(_ODD_VALUES + _BIG_INTS))
    raw = json.dumps(body)
    return (raw[:-1] + f', "{key}": {extra}' + "}").encode()


def _truncated(rng, body):
    raw = json.dumps(body).encode()
    return raw[:rng.randrange(len(raw))]


MUTATIONS = {"deep_nesting": _nest, "surrogate": _surrogate, "huge_int": _huge_int,
             "nan": _nan, "wrong_type": _wrong_type, "invalid_utf8": _invalid_utf8,
             "duplicate_keys": _duplicate_keys, "truncated": _truncated,
             "wrong_content_type": lambda rng, body: json.dumps(body).encode()}


def generate(count: int, seed: int = 0) -> Iterator[Case]:
    """`count` mutated requests, the classes in turn (so each gets count / 9 cases)."""
    rng = random.Random(seed)
    names = list(MUTATIONS)
    for i in range(count):
        name = names[i % len(names)]
        path, body = _base(rng)
        raw = MUTATIONS[name](rng, body)
        ctype = rng.choice(_CONTENT_TYPES) if name == "wrong_content_type" else JSON
        yield name, path, ctype, raw
