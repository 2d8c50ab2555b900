"""Structured outputs through the real server on the embedded model (SmolLM2, real weights):
the openai SDK's ``beta.chat.completions.parse`` with a pydantic model gets a parsed
object; a constrained stream's text equals the same request unstreamed, byte for byte, on
both endpoints; a constraint that does not compile is a 400 from the real server."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["color", "count"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server  # the session's default server (tests/conftest.py)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_sdk_parse_returns_the_pydantic_object(client):
    completion = client.beta.chat.completions.parse(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Alice is 30 years old. Give her name and age."}],
        response_format=Person, temperature=0, max_tokens=96,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert message.parsed == Person.model_validate_json(message.content)


def test_chat_stream_equals_non_stream_under_a_schema(client):
    kw = dict(model=client.models.list().data[0].id,
              messages=[{"role": "user", "content": "Pick a color and a count."}],
              response_format={"type": "json_schema",
                               "json_schema": {"name": "pick", "schema": COLOR}},
              temperature=0.8, seed=3, max_tokens=48)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert json.loads(text)["color"] in ("red", "green", "blue")
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [r for r in reasons if r] == [full.choices[0].finish_reason] == ["stop"]


def test_completion_stream_equals_non_stream_under_a_regex(client):
    kw = dict(model=client.models.list().data[0].id, prompt="Call me at", temperature=1.0,
              seed=5, max_tokens=16, extra_body={"guided_regex": PHONE})
    full = client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert text == full.choices[0].text
    assert re.fullmatch(PHONE, text)


def test_a_grammar_that_does_not_compile_is_a_400(server):
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                   json={"prompt": "x", "guided_grammar": "start: missing", "stream": True})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "guided_grammar"
