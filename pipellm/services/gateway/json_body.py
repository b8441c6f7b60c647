"""A request body as a whole, before any field is read: read, decoded and checked as JSON that
every service downstream can carry (UTF-8, bounded nesting, signed 64-bit integers, finite
floats, valid Unicode), and the prompt's size in bytes; every failure a 400 (413 past the size
limit) `APIError`. Fields are read by validation.py.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import web

from pipellm.services.gateway.errors import APIError, bad_request

_INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop (< 1 ms)

MAX_JSON_DEPTH = 32  # nesting of arrays/objects; real requests need 4 (chat content parts)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what the msgpack codec (and torch int64) carries
_INT_RANGE = "is out of range (signed 64-bit)"


class _Reject(ValueError):
    """Raised by the json.loads hook; becomes a 400."""


def _no_constant(name: str):
    raise _Reject(f"{name} is not valid JSON (only finite numbers are accepted)")


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body, or raise a 400 `APIError`: it must be UTF-8 JSON without
    NaN/Infinity literals, and pass `check_json_value`. Never raises anything else."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"Request body is not valid UTF-8: {e}") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(f"Request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except _Reject as e:
        raise bad_request(f"Request body is not acceptable: {e}") from None
    except ValueError as e:  # JSONDecodeError, or an integer literal of > 4300 digits
        if "integer string conversion" in str(e):
            raise bad_request(f"an integer in the request body {_INT_RANGE}") from None
        raise bad_request(f"Request body is not valid JSON: {e}"[:300]) from None
    check_json_value(body)
    return body


def check_json_value(body: Any) -> None:
    """400 unless every value in the decoded body is safe for every service downstream:
    containers nested at most MAX_JSON_DEPTH deep, integers in the signed 64-bit range, floats
    finite, and every string (object keys included) valid Unicode. Lone UTF-16 surrogates
    ("\\ud800" escapes) are rejected, not replaced: they cannot be encoded as UTF-8, and a
    silently altered prompt or stop string would be worse than an error.

    Iterative, one nesting level at a time (no recursion, so no input can exhaust the stack),
    with homogeneous containers checked in bulk at C speed. `param` in the error is the
    top-level key the bad value sits under."""
    if isinstance(body, dict):
        _check_scalars(body.keys(), str, None)
        for key, value in body.items():
            _walk(value, 2, key)
    else:
        _walk(body, 1, None)


def _walk(value: Any, depth: int, top: str | None) -> None:
    """Check `value`, found at nesting `depth`, level by level: `level` holds the containers
    at `depth`; their values are checked in bulk per type, their containers form the next."""
    if not isinstance(value, dict | list):
        _check_scalars((value,), type(value), top)
        return
    level = [value]
    while level:
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"Request body is nested deeper than {MAX_JSON_DEPTH} levels", top)
        deeper: list = []
        for node in level:
            if isinstance(node, dict):
                if not all(map(str.isascii, node)):
                    _check_strings(node.keys(), top)
                node = node.values()
            kinds = set(map(type, node))
            if kinds <= _CONTAINERS:
                deeper.extend(node)
                continue
            for kind in kinds:
                group = node if len(kinds) == 1 else [v for v in node if type(v) is kind]
                if kind in _CONTAINERS:
                    deeper.extend(group)
                else:
                    _check_scalars(group, kind, top)
        level, depth = deeper, depth + 1


_CONTAINERS = frozenset({dict, list})


def _check_scalars(values, kind: type, top: str | None) -> None:
    """Check JSON scalars that are all of type `kind`, in bulk (C-speed builtins)."""
    if kind is str:
        if not all(map(str.isascii, values)):
            _check_strings(values, top)
    elif kind is int:
        _check_int(min(values, default=0), top)
        _check_int(max(values, default=0), top)
    elif kind is float and not all(map(math.isfinite, values)):
        raise bad_request("numbers must be finite (this one overflows a double)", top)


def _check_int(value: int, top: str | None) -> None:
    if not INT64_MIN <= value <= INT64_MAX:
        raise bad_request(f"integer {str(value)[:24]} {_INT_RANGE}", top)


def _check_strings(texts, top: str | None) -> None:
    for text in texts:
        if text.isascii():
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = text[e.start:e.end].encode("unicode_escape").decode("ascii")
            raise bad_request(f"strings must be valid Unicode: lone surrogate {bad} at index "
                              f"{e.start} (surrogates are rejected, not replaced)",
                              top if top is not None and _valid(top) else None) from None


def _valid(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_prompt_bytes(prompts: tuple, messages: tuple | None, limit: int) -> None:
    """400 when the prompt (a completion's texts together, or the chat message contents) is
    over `limit` bytes of UTF-8: tokenizing it would keep a tokenizer worker from everyone
    else."""
    texts = [p for p in prompts if isinstance(p, str)] if prompts else \
        [m.content for m in messages or ()]
    chars = sum(map(len, texts))  # chars <= UTF-8 bytes <= 4 * chars: encode only if unsure
    if chars <= limit // 4 or (chars <= limit
                               and sum(len(t.encode("utf-8")) for t in texts) <= limit):
        return
    raise bad_request(f"The prompt is longer than {limit} bytes of UTF-8 text, the most this "
                      f"server accepts (its --max-prompt-bytes); send a shorter prompt",
                      "prompt" if prompts else "messages", "prompt_too_large")


async def read_json_body(request: web.Request) -> Any:
    """The request's JSON body, checked (parse_json_body); 413 past the size limit."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, "Request body is too large.", code="payload_too_large") from None
    except web.RequestPayloadError:  # e.g. a Content-Encoding: gzip body that is not gzip
        raise APIError(400, "Request body could not be decoded (its Content-Encoding or "
                            "Transfer-Encoding is broken).") from None
    if len(raw) <= _INLINE_PARSE_BYTES:  # 400 unless UTF-8 JSON, bounded depth, ints, floats
        return parse_json_body(raw)
    # the checks of a large body are Python code: on a thread, the event loop serves meanwhile
    return await asyncio.get_running_loop().run_in_executor(None, parse_json_body, raw)
