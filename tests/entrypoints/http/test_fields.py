"""The request models' shared checks: lone surrogates, located errors, JSON schemas."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import BaseModel, ValidationError, model_validator

from atom_core.entrypoints.http.fields import (
    check_unicode,
    field_error,
    json_schema_problem,
    lone_surrogate,
)


@pytest.mark.parametrize(
    ("data", "loc"),
    [
        ({"a": "fine", "b": ["x", "y\ud800"]}, ("b", 1)),
        ({"messages": [{"content": "\udfff"}]}, ("messages", 0, "content")),
        ({"a": {"k\udc00": 1}}, ("a",)),  # a key: the object holding it
        ("\udc00\ud800", ()),  # a reversed pair is two lone halves
        ({"prompt": [1, 2, "\ud800"]}, ("prompt", 2)),
    ],
)
def test_lone_surrogates_are_located(data, loc):
    assert lone_surrogate(data) == loc


@pytest.mark.parametrize(
    "data",
    [
        "plain",
        "\u00e9\u4e2d\U0001f600",
        json.loads('"\\ud83d\\ude00"'),  # a pair of escapes in JSON is one character
        {"a": [1, 2.5, None, True]},
        [],
    ],
)
def test_valid_text_and_scalars_pass(data):
    assert lone_surrogate(data) is None


def test_nesting_deeper_than_the_recursion_limit_is_walked():
    data = "\ud800"
    for _ in range(5000):
        data = [data]
    assert lone_surrogate({"x": data}) == ("x",) + (0,) * 5000


def test_long_prompts_and_token_lists_are_cheap():
    """On the event loop for every request: an ASCII prompt costs nothing, a token list is
    skipped in C, a long non-ASCII prompt is one encode."""
    payloads = [{"prompt": "a" * 10_000_000}, {"prompt": [list(range(200_000))]},
                {"prompt": "\u00e9" * 5_000_000}]  # fmt: skip
    for payload in payloads:
        started = time.perf_counter()
        assert lone_surrogate(payload) is None
        assert time.perf_counter() - started < 0.2  # a regex scan of the last takes ~0.4 s


class Inner(BaseModel):
    text: str

    @model_validator(mode="after")
    def _named(self) -> Inner:
        if self.text == "bad":
            raise field_error("Inner", ("text",), "text may not be 'bad'", self.text)
        return self


class Outer(BaseModel):
    items: list[Inner]

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        return check_unicode("Outer", data)


def test_errors_are_located_below_the_validator_that_raised_them():
    with pytest.raises(ValidationError) as info:
        Outer.model_validate({"items": [{"text": "ok"}, {"text": "bad"}]})
    [error] = info.value.errors()
    assert error["loc"] == ("items", 1, "text") and error["msg"] == "text may not be 'bad'"
    with pytest.raises(ValidationError) as info:
        Outer.model_validate({"items": [{"text": "\ud800"}]})
    [error] = info.value.errors()
    assert error["loc"] == ("items", 0, "text") and "surrogate" in error["msg"]


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": ["string", "null"]},
        {"$defs": {"x": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/x"}}},
    ],
)
def test_json_schemas_pass(schema):
    assert json_schema_problem(schema) is None


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "banana"}, "type"),
        ({"type": "object", "properties": 5}, "properties"),
        ({"type": "object", "required": "a"}, "required"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "properties.a.type"),
        ({"items": [{"type": 1}]}, "items[0].type"),
    ],
)
def test_what_is_not_a_json_schema_is_named(schema, where):
    problem = json_schema_problem(schema)
    assert problem is not None and problem.startswith(f"not a valid JSON schema: {where}:")
