"""Typed readers for fields of a JSON request body; every failure is a 400 `APIError`.

A field that is absent or JSON null reads as absent (OpenAI treats nullable fields that way).
JSON booleans are never accepted as numbers, and integers given as floats (16.0) are rejected.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import web

from services.gateway.errors import APIError, bad_request

_INLINE_PARSE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop (< 1 ms)

MAX_STOP_STRINGS = 16
MAX_TOKEN_ID = 2**31 - 1  # token ids must fit int32; the gateway checks them against the vocab


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _wrong(param: str, expected: str, value: Any) -> APIError:
    return bad_request(f"{param} must be {expected}, got {json_type(value)}", param)


def same(a: Any, b: Any) -> bool:
    """Equality that does not confuse types (0 vs False, 1.0 vs 1), recursively for containers."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def is_int(value: Any) -> bool:
    """A JSON integer (bool excluded)."""
    return isinstance(value, int) and not isinstance(value, bool)


def get_int(body: dict, key: str, default: int | None = None, *,
            lo: int | None = None, hi: int | None = None) -> int | None:
    """body[key] as an integer in [lo, hi] (bounds optional), or `default` when absent."""
    value = body.get(key)
    if value is None:
        return default
    if not is_int(value):
        raise _wrong(key, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"between {lo} and {hi}" if lo is not None and hi is not None else (
            f"at least {lo}" if lo is not None else f"at most {hi}")
        raise bad_request(f"{key} must be {span}, got {value}", key)
    return value


def get_number(body: dict, key: str, default: float | None) -> float | None:
    """body[key] as a finite float (JSON integer or number), or `default` when absent."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _wrong(key, "a number", value)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"{key} must be a finite number", key)
    return number


def get_bool(body: dict, key: str, default: bool) -> bool:
    """body[key] as a boolean, or `default` when absent."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _wrong(key, "a boolean", value)
    return value


def get_str(body: dict, key: str, default: str | None = None) -> str | None:
    """body[key] as a string, or `default` when absent."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _wrong(key, "a string", value)
    return value


def check_request_id(value: str | None, param: str) -> str | None:
    """A client's request id (the `request_id` field or the X-Request-Id header): 1 to 128
    printable ASCII characters, no spaces, no ':' (it names the request in logs and Redis
    keys, and its choices' ids append ':<index>': shared/choice.py)."""
    if value is not None and not (0 < len(value) <= 128 and value.isascii()
                                  and value.isprintable() and not set(value) & {" ", ":"}):
        raise bad_request(f"{param} must be 1 to 128 printable ASCII characters without "
                          "spaces or ':'", param)
    return value


def token_ids(value: Any, param: str) -> tuple[int, ...]:
    """A JSON array of token ids (integers in [0, 2^31)) as a tuple."""
    if not isinstance(value, list):
        raise _wrong(param, "an array of token ids", value)
    for i, tok in enumerate(value):
        if not is_int(tok) or not 0 <= tok <= MAX_TOKEN_ID:
            raise bad_request(f"{param}[{i}] must be a token id (an integer in "
                              f"[0, {MAX_TOKEN_ID}]), got {tok!r}"[:200], param)
    return tuple(value)


def get_stop(body: dict) -> tuple[str, ...]:
    """`stop`: a non-empty string or an array of up to 16 non-empty strings (null: none)."""
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise _wrong("stop", "a string or an array of strings", value)
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(items)}",
                          "stop")
    for item in items:
        if not isinstance(item, str):
            raise _wrong("stop", "a string or an array of strings", item)
        if not item:
            raise bad_request("stop strings must not be empty", "stop")
    return tuple(items)


def reject_unknown(body: dict, allowed: frozenset[str], ignored: list[str] | None = None,
                   where: str = "") -> None:
    """Keys not in `allowed`: appended to `ignored` (as vLLM serves them: ignored, logged), or
    without that list (strict) a 400 "Unrecognized request argument supplied: X" for the
    first. `where`: the object's place in the body ("messages[0]"), "" for the body."""
    for key in body:
        if key not in allowed:
            name = f"{where}.{key}" if where else str(key)
            if ignored is None:
                raise bad_request(f"Unrecognized request argument supplied: {name}"[:300],
                                  name)
            ignored.append(name[:100])


def reject_unsupported(body: dict, neutral: dict[str, tuple]) -> None:
    """400 "`X` is not supported" when field X is present with a value other than null or one of
    its harmless `neutral[X]` values (compared with `same`)."""
    for key, harmless in neutral.items():
        value = body.get(key)
        if value is not None and not any(same(value, ok) for ok in harmless):
            raise bad_request(f"`{key}` is not supported", key)


# -- the whole body, before any field is read --------------------------------------------------

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
