"""The gateway's structured-output fields -> GrammarSpec, and their 400s (no services)."""

from __future__ import annotations

import json

import pytest

from pipellm.services.gateway.errors import APIError
from pipellm.services.gateway.protocol import parse_chat, parse_completion
from pipellm.shared.grammar import GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def chat(**kw):
    return parse_chat({**CHAT, **kw}, "m").grammar


def completion(**kw):
    return parse_completion({**COMPLETION, **kw}, "m").grammar


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"response_format": None}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}},
     GrammarSpec("json_schema", json.dumps(SCHEMA), param="response_format.json_schema.schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     GrammarSpec("json_object")),
    ({"structured_outputs": {"json": SCHEMA}},
     GrammarSpec("json_schema", json.dumps(SCHEMA), param="structured_outputs.json")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
     GrammarSpec("json_schema", json.dumps(SCHEMA), "compact", "structured_outputs.json")),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_fallback": True}},
     GrammarSpec("regex", "[0-9]+", param="structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["a", "b"]}},
     GrammarSpec("choice", '["a", "b"]', param="structured_outputs.choice")),
    ({"structured_outputs": {"grammar": "root ::= \"x\""}},
     GrammarSpec("grammar", 'root ::= "x"', param="structured_outputs.grammar")),
    ({"structured_outputs": {"json_object": True}},
     GrammarSpec("json_object", param="structured_outputs.json_object")),
    ({"guided_regex": "a|b"}, GrammarSpec("regex", "a|b", param="guided_regex")),
    ({"guided_choice": ["x"]}, GrammarSpec("choice", '["x"]', param="guided_choice")),
    ({"guided_json": SCHEMA}, GrammarSpec("json_schema", json.dumps(SCHEMA),
                                          param="guided_json")),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]?"}},
     GrammarSpec("json_schema", json.dumps(SCHEMA), param="structured_outputs.json",
                 whitespace_pattern="[ ]?")),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": "\n?"},
     GrammarSpec("json_schema", json.dumps(SCHEMA), param="guided_json",
                 whitespace_pattern="\n?")),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": " "},
     GrammarSpec("json_object", whitespace_pattern=" ")),
])
def test_chat_fields_give_the_spec(body, want):
    assert chat(**body) == want


def test_completions_take_every_constraint_field_as_vllm_does():
    assert completion(structured_outputs={"regex": "a"}).kind == "regex"
    assert completion(guided_grammar="root ::= \"a\"").kind == "grammar"
    assert completion(response_format={"type": "json_object"}).kind == "json_object"


@pytest.mark.parametrize("body, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{not json"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}}, "strict"),
    ({"structured_outputs": []}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "("}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": 1}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?",
                             "disable_any_whitespace": True}},
     "structured_outputs.whitespace_pattern"),
    ({"guided_whitespace_pattern": " ?"}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}},
     "disable_any_whitespace"),
    ({"structured_outputs": {"grammar": "x" * (256 * 1024 + 1)}}, "structured_outputs.grammar"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_malformed_fields_are_400s_naming_them(body, param):
    with pytest.raises(APIError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, str(e.value))
