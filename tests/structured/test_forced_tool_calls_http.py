"""The request side of forced tool calls: tool_choice required / named / Anthropic's any
put the format's grammar in the engine request; a server without a tool format, or a second
output constraint beside it, is a 400 naming the field, before any engine request."""

from __future__ import annotations

import pytest

from atom_core.parsing.response import ResponseParser
from tests.entrypoints.http.asgi_app import make_app, post
from tests.entrypoints.http.fake_engine import MODEL, FakeEngineClient
from tests.parsing.shared_templates import template_path

TOOLS = [{"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                       "required": ["tz"]}}}]
USER = [{"role": "user", "content": "Time in Rome?"}]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Rome"}}\n</tool_call>'


def app(tool_format: str | None = None):
    engine = FakeEngineClient(reply=CALL, max_model_len=4096,
                              chat_template=template_path("qwen3").read_text())
    kw = {} if tool_format is None else {"parser": ResponseParser.from_names(tool_format)}
    return engine, make_app(engine, **kw)


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_a_forcing_tool_choice_sends_the_formats_grammar(tool_choice):
    engine, api = app()
    r = post(api, "/v1/chat/completions", {"model": MODEL, "messages": USER, "tools": TOOLS,
                                           "tool_choice": tool_choice})
    assert r.status_code == 200, r.text
    spec = engine.calls[0][1].structured
    assert spec.kind == "grammar" and spec.param == "tool_choice"
    assert '"<tool_call>\\n"' in spec.value and '"const": "get_time"' in spec.value
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
def test_other_tool_choices_leave_the_reply_free(tool_choice):
    engine, api = app()
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": tool_choice}
    assert post(api, "/v1/chat/completions", body).status_code == 200
    assert engine.calls[0][1].structured is None


def test_anthropic_any_sends_the_grammar():
    engine, api = app()
    body = {"model": MODEL, "max_tokens": 64, "messages": USER, "tool_choice": {"type": "any"},
            "tools": [{"name": "get_time", "input_schema": TOOLS[0]["function"]["parameters"]}]}
    r = post(api, "/v1/messages", body)
    assert r.status_code == 200, r.text
    assert engine.calls[0][1].structured.param == "tool_choice"


@pytest.mark.parametrize("tool_format, markers", [
    ("harmony", ['commentary to=functions.get_time "', '<|call|>"']),
    ("kimi_k3", ['"<|open|>call<|sep|>get_time<|sep|>"', '"<|close|>call<|sep|>"']),
])
def test_channel_formats_send_their_grammar(tool_format, markers):
    engine, api = app(tool_format)
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required"}
    assert post(api, "/v1/chat/completions", body).status_code == 200
    spec = engine.calls[0][1].structured
    assert spec.param == "tool_choice" and all(m in spec.value for m in markers)


def test_a_server_without_a_tool_format_is_a_400():
    engine, api = app("none")
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required"}
    r = post(api, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "this server has none" in r.json()["error"]["message"]
    assert not engine.calls


def test_a_second_constraint_is_a_400():
    engine, api = app()
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}}
    r = post(api, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format"
    assert "tool_choice forces a tool call" in r.json()["error"]["message"]
    assert not engine.calls
