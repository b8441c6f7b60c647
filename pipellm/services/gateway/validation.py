"""Typed readers for fields of a JSON request body; every failure is a 400 `APIError`.

A field that is absent or JSON null reads as absent (OpenAI treats nullable fields that way).
JSON booleans are never accepted as numbers, and integers given as floats (16.0) are rejected.
"""

from __future__ import annotations

import math
from typing import Any

from pipellm.services.gateway.errors import APIError, bad_request

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
    keys, and its choices' ids append ':<index>': pipellm/shared/choice.py)."""
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

