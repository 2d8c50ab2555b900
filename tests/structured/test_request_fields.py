"""The request side: OpenAI's response_format and vLLM's guided_* / structured_outputs
become one StructuredSpec in the engine request, on both endpoints; a malformed, unusable
or second constraint, or one beside speculative decoding, is a 400 in OpenAI's shape
naming the field, before any engine request."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from atom_core.structured import StructuredSpec
from atom_core.structured.spec import ANY_JSON_OBJECT
from tests.entrypoints.http.asgi_app import post
from tests.entrypoints.http.fake_engine import USER, FakeEngineClient, assert_error

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def body(path: str, **fields) -> dict:
    return {"messages": USER, **fields} if path == CHAT else {"prompt": "hi", **fields}


def sent_spec(path: str, **fields) -> StructuredSpec | None:
    engine = FakeEngineClient()
    response = post(engine, path, body(path, **fields))
    assert response.status_code == 200, response.text
    return engine.calls[0][1].structured


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}},
     StructuredSpec("json", ANY_JSON_OBJECT, "response_format")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredSpec("json", json.dumps(SCHEMA), "response_format")),
    ({"guided_json": SCHEMA}, StructuredSpec("json", json.dumps(SCHEMA), "guided_json")),
    ({"guided_json": json.dumps(SCHEMA)},
     StructuredSpec("json", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "[0-9]+"}, StructuredSpec("regex", "[0-9]+", "guided_regex")),
    ({"guided_choice": ["yes", "no"]}, StructuredSpec("choice", '["yes", "no"]', "guided_choice")),
    ({"guided_grammar": 'start: "a"'}, StructuredSpec("grammar", 'start: "a"', "guided_grammar")),
    ({"structured_outputs": {"regex": "a+"}},
     StructuredSpec("regex", "a+", "structured_outputs")),
    ({"structured_outputs": {"json_object": True}},
     StructuredSpec("json", ANY_JSON_OBJECT, "structured_outputs")),
    ({"response_format": None, "guided_regex": None}, None),  # null: not given
])
def test_each_spelling_becomes_one_spec(path, fields, expected):
    assert sent_spec(path, **fields) == expected


BAD = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "string", "minLength": 3, "maxLength": 1}}}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "param"), BAD)
def test_a_bad_constraint_is_a_400_naming_its_field(path, fields, param):
    engine = FakeEngineClient()
    response = post(engine, path, body(path, **fields, stream=True))
    assert_error(response, 400, param, "invalid_request_error")
    assert engine.calls == []


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_speculative_decoding_refuses_a_constraint_before_the_stream(path):
    engine = FakeEngineClient()
    engine.config = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram"))
    response = post(engine, path, body(path, guided_regex="a+", stream=True))
    err = assert_error(response, 400, "guided_regex")
    assert "speculative decoding" in err["message"]
    assert post(engine, path, body(path)).status_code == 200  # without one it serves
