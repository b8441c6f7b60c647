"""Structured-output fields of a request -> its GrammarSpec (shape checks only: the tokenizer
compiles it, and a spec that does not compile is a 400 from there, before any compute).

    response_format       {"type": "text"} | {"type": "json_object"} |
                          {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs    vLLM's extra field, both endpoints: exactly one of json (a schema,
                          object or JSON text), json_object (true), regex, choice (strings),
                          grammar (EBNF with ::= rules, or Lark); disable_any_whitespace (JSON
                          without whitespace) or whitespace_pattern (JSON whose whitespace
                          between tokens matches this regex); disable_fallback and
                          disable_additional_properties (what xgrammar's strict mode does
                          anyway) are accepted
    guided_json, guided_regex, guided_choice, guided_grammar, guided_whitespace_pattern
                          vLLM's older names for the same, both endpoints

One constraint per request: giving two (say response_format and structured_outputs) is a 400.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipellm.services.gateway.errors import bad_request
from pipellm.services.gateway.validation import get_bool, json_type
from pipellm.shared.grammar import GrammarSpec

MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar's text
_SO_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
             "choice": "choice", "grammar": "grammar"}
_SO_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
KEYS = frozenset({"response_format", "structured_outputs", "guided_whitespace_pattern", *GUIDED})


def parse_grammar(body: dict) -> GrammarSpec | None:
    """The request's output constraint, or None for free text (either endpoint, as vLLM)."""
    specs = [s for s in (_response_format(body.get("response_format")),
                         _structured_outputs(body.get("structured_outputs")),
                         *(_one(GUIDED[k], body[k], k) for k in GUIDED if body.get(k) is not None))
             if s is not None]
    if len(specs) > 1:
        raise bad_request("give one output constraint: response_format, structured_outputs or "
                          "one guided_* field", specs[1].param)
    spec = specs[0] if specs else None
    if body.get("guided_whitespace_pattern") is not None:
        _whitespace_pattern(spec, body["guided_whitespace_pattern"], "guided_whitespace_pattern")
    return spec


def _response_format(value: Any) -> GrammarSpec | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"response_format must be an object, got {json_type(value)}", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", param=param)
    if kind != "json_schema":
        raise bad_request("response_format.type must be 'text', 'json_object' or "
                          f"'json_schema', got {str(kind)[:50]!r}", f"{param}.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with name and schema",
                          f"{param}.json_schema")
    get_bool(spec, "strict", None)
    schema = spec.get("schema")
    if schema is None:  # no schema: any JSON object
        return GrammarSpec("json_object", param=param)
    return GrammarSpec("json_schema", _schema_text(schema, f"{param}.json_schema.schema"),
                       param=f"{param}.json_schema.schema")


def _structured_outputs(value: Any) -> GrammarSpec | None:
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"structured_outputs must be an object, got {json_type(value)}", param)
    for key in value:
        if key not in _SO_KINDS and key not in _SO_OPTIONS and key != "whitespace_pattern":
            raise bad_request(f"structured_outputs.{str(key)[:50]} is not supported",
                              f"{param}.{str(key)[:50]}")
    given = [k for k in _SO_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request("structured_outputs needs exactly one of json, json_object, regex, "
                          f"choice, grammar (got {len(given)})", param)
    for option in _SO_OPTIONS:
        get_bool(value, option, False)
    spec = _one(given[0], value[given[0]], f"{param}.{given[0]}")
    if get_bool(value, "disable_any_whitespace", False):
        spec.whitespace = "compact"
    if value.get("whitespace_pattern") is not None:
        _whitespace_pattern(spec, value["whitespace_pattern"], f"{param}.whitespace_pattern")
    return spec


def _whitespace_pattern(spec: GrammarSpec | None, pattern: Any, param: str) -> None:
    """The JSON constraint `spec`'s whitespace, as a regex (the tokenizer compiles it)."""
    if spec is None or spec.kind not in ("json_schema", "json_object"):
        raise bad_request(f"{param} applies to a JSON constraint only", param)
    if spec.whitespace != "any":
        raise bad_request(f"give disable_any_whitespace or {param}, not both", param)
    if not isinstance(pattern, str):
        raise bad_request(f"{param} must be a string (a regex)", param)
    try:
        re.compile(pattern)
    except re.error as exc:
        raise bad_request(f"{param} is not a valid regex: {exc}", param) from None
    spec.whitespace_pattern = _capped(pattern, param)


def _one(key: str, value: Any, param: str) -> GrammarSpec:
    """One constraint, named `key` as structured_outputs names it."""
    if key == "json":
        return GrammarSpec("json_schema", _schema_text(value, param), param=param)
    if key == "json_object":
        if value is not True:
            raise bad_request(f"{param} must be true", param)
        return GrammarSpec("json_object", param=param)
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"{param} must be a non-empty list of strings", param)
        return GrammarSpec("choice", _capped(json.dumps(value), param), param=param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return GrammarSpec(_SO_KINDS[key], _capped(value, param), param=param)


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or JSON text of one) as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{param} is not valid JSON", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object, got {json_type(schema)}",
                          param)
    return _capped(json.dumps(schema), param)


def _capped(text: str, param: str) -> str:
    if len(text) > MAX_SPEC_CHARS:
        raise bad_request(f"{param} is longer than {MAX_SPEC_CHARS} characters", param)
    return text
