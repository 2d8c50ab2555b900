"""Bad input is a 400 in the API's error shape, never a 500, on a real server.

Each case would be a 500 or a 200 if the request models let it through: integers past int64
(the engine link cannot carry them; a 500 from its encoder), lone UTF-16 surrogates in
any text (the tokenizer, and the JSON encoder of an error quoting them, raise), a message
without content, a tool whose parameters are not a JSON schema, a malformed past tool
call, an Anthropic tool without input_schema. OpenAI and Anthropic answer each with a 400.
Their well-formed neighbours are still served (``test_the_edges_are_still_served``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import API_KEY

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
USER = [{"role": "user", "content": "hi"}]
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": USER, "max_tokens": 4},
    COMPLETIONS: {"model": "tiny", "prompt": "hi", "max_tokens": 4},
    MESSAGES: {"model": "tiny", "messages": USER, "max_tokens": 4},
}
BIG = (2**63, 2**64, -(2**63) - 1)  # just past int64, past uint64, just below int64

# (field, the body's change for a value v, the param the error names)
INT_FIELDS: dict[str, list[tuple[str, Any, str]]] = {
    CHAT: [
        ("max_tokens", lambda v: {"max_tokens": v}, "max_tokens"),
        ("max_completion_tokens", lambda v: {"max_completion_tokens": v}, "max_completion_tokens"),
        ("seed", lambda v: {"seed": v}, "seed"),
        ("n", lambda v: {"n": v}, "n"),
        ("top_k", lambda v: {"top_k": v}, "top_k"),
        ("top_logprobs", lambda v: {"logprobs": True, "top_logprobs": v}, "top_logprobs"),
        ("stop_token_ids", lambda v: {"stop_token_ids": [1, v]}, "stop_token_ids[1]"),
        ("logit_bias key", lambda v: {"logit_bias": {str(v): 1}}, "logit_bias"),
        ("logit_bias value", lambda v: {"logit_bias": {"1": v}}, "logit_bias"),
        ("min_tokens", lambda v: {"min_tokens": v}, "min_tokens"),
    ],
    COMPLETIONS: [
        ("max_tokens", lambda v: {"max_tokens": v}, "max_tokens"),
        ("seed", lambda v: {"seed": v}, "seed"),
        ("n", lambda v: {"n": v}, "n"),
        ("top_k", lambda v: {"top_k": v}, "top_k"),
        ("logprobs", lambda v: {"logprobs": v}, "logprobs"),
        ("best_of", lambda v: {"best_of": v}, "best_of"),
        ("stop_token_ids", lambda v: {"stop_token_ids": [v]}, "stop_token_ids[0]"),
        ("min_tokens", lambda v: {"min_tokens": v}, "min_tokens"),
        ("prompt token id", lambda v: {"prompt": [1, v]}, "prompt"),
        ("prompt batch token id", lambda v: {"prompt": [[1], [2, v]]}, "prompt"),
    ],
    MESSAGES: [
        ("max_tokens", lambda v: {"max_tokens": v}, "max_tokens"),
        ("top_k", lambda v: {"top_k": v}, "top_k"),
        ("thinking.budget_tokens", lambda v: {"thinking": {"type": "enabled", "budget_tokens": v}},
         "thinking.budget_tokens"),
    ],
}  # fmt: skip


def int_cases() -> list[Any]:
    return [
        pytest.param(path, change(v), param, id=f"{path} {field}={v}")
        for path, fields in INT_FIELDS.items()
        for field, change, param in fields
        for v in BIG
    ]


LONE = "\ud800"  # a lone high surrogate; json.dumps writes it as the escape \ud800
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (path, name, the body's change, the param the error names; None on /v1/messages, whose
# errors have no param)
SURROGATE_CASES = [
    (CHAT, "content", {"messages": [{"role": "user", "content": f"a{LONE}b"}]},
     "messages[0].content"),
    (CHAT, "low surrogate", {"messages": [{"role": "user", "content": "\udfff"}]},
     "messages[0].content"),
    (CHAT, "reversed pair", {"messages": [{"role": "user", "content": "\udc00\ud800"}]},
     "messages[0].content"),
    (CHAT, "content part", {"messages": [{"role": "user", "content": [{"type": "text",
     "text": LONE}]}]}, "messages[0].content[0].text"),
    (CHAT, "system", {"messages": [{"role": "system", "content": LONE}, *USER]},
     "messages[0].content"),
    (CHAT, "name", {"messages": [{"role": "user", "content": "hi", "name": LONE}]},
     "messages[0].name"),
    (CHAT, "reasoning_content", {"messages": [*USER, {"role": "assistant", "content": "x",
     "reasoning_content": LONE}, *USER]}, "messages[1].reasoning_content"),
    (CHAT, "stop", {"stop": LONE}, "stop"),
    (CHAT, "stop list", {"stop": ["ok", LONE]}, "stop[1]"),
    (CHAT, "model", {"model": LONE}, "model"),
    (CHAT, "user", {"user": LONE}, "user"),
    (CHAT, "tool name", {"tools": [{"type": "function", "function": {"name": LONE}}]},
     "tools[0].function.name"),
    (CHAT, "tool description", {"tools": [{"type": "function", "function": {"name": "f",
     "description": LONE}}]}, "tools[0].function.description"),
    (CHAT, "tool call arguments", {"messages": [*USER, {"role": "assistant", "tool_calls": [
     {"id": "c", "type": "function", "function": {"name": "f", "arguments": LONE}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, "chat_template_kwargs", {"chat_template_kwargs": {"x": LONE}}, "chat_template_kwargs.x"),
    (CHAT, "unknown field's key", {f"x{LONE}": 1}, None),
    (COMPLETIONS, "prompt", {"prompt": f"a{LONE}"}, "prompt"),
    (COMPLETIONS, "prompt batch", {"prompt": ["ok", LONE]}, "prompt[1]"),
    (COMPLETIONS, "stop", {"stop": [LONE]}, "stop[0]"),
    (COMPLETIONS, "model", {"model": LONE}, "model"),
    (MESSAGES, "content", {"messages": [{"role": "user", "content": f"a{LONE}"}]}, None),
    (MESSAGES, "text block", {"messages": [{"role": "user", "content": [{"type": "text",
     "text": LONE}]}]}, None),
    (MESSAGES, "system", {"system": LONE}, None),
    (MESSAGES, "stop_sequences", {"stop_sequences": [LONE]}, None),
    (MESSAGES, "model", {"model": LONE}, None),
    (MESSAGES, "tool description", {"tools": [{"name": "f", "description": LONE,
     "input_schema": {"type": "object"}}]}, None),
]  # fmt: skip


def call(function: Any) -> dict[str, Any]:
    return {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [function]}]}


def tool(parameters: Any) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}


def anthropic_tool(**tool: Any) -> dict[str, Any]:
    return {"tools": [{"name": "f", **tool}]}


GOOD_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

SHAPE_CASES = [
    # A message without content: OpenAI requires it on every turn but an assistant's that
    # calls tools.
    (CHAT, "user without content", {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, "user content null", {"messages": [{"role": "user", "content": None}]},
     "messages[0].content"),
    (CHAT, "system content null", {"messages": [{"role": "system", "content": None}, *USER]},
     "messages[0].content"),
    (CHAT, "developer without content", {"messages": [{"role": "developer"}, *USER]},
     "messages[0].content"),
    (CHAT, "tool without content", {"messages": [*USER, {"role": "tool", "tool_call_id": "c1"}]},
     "messages[1].content"),
    (CHAT, "assistant without content or calls", {"messages": [*USER, {"role": "assistant"}]},
     "messages[1].content"),
    (CHAT, "assistant with an empty call list", {"messages": [*USER, {"role": "assistant",
     "content": None, "tool_calls": []}]}, "messages[1].content"),
    (CHAT, "no content parts", {"messages": [{"role": "user", "content": []}]},
     "messages[0].content"),
    # Tool parameters that are not a JSON schema
    (CHAT, "parameters a string", tool("object"), "tools[0].function.parameters"),
    (CHAT, "parameters an array", tool([{"type": "object"}]), "tools[0].function.parameters"),
    (CHAT, "parameters a number", tool(5), "tools[0].function.parameters"),
    (CHAT, "parameters of an unknown type", tool({"type": "banana"}),
     "tools[0].function.parameters"),
    (CHAT, "parameters with properties not an object", tool({"type": "object", "properties": 5}),
     "tools[0].function.parameters"),
    (CHAT, "parameters with required not an array", tool({"type": "object", "required": "a"}),
     "tools[0].function.parameters"),
    (CHAT, "nested schema of an unknown type", tool({"type": "object", "properties":
     {"a": {"type": "strin"}}}), "tools[0].function.parameters"),
    (CHAT, "tool without function", {"tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, "tool without name", {"tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    (CHAT, "tool name not a string", {"tools": [{"type": "function", "function": {"name": 5}}]},
     "tools[0].function.name"),
    (CHAT, "tool of another type", {"tools": [{**TOOL, "type": "retrieval"}]}, "tools[0].type"),
    (CHAT, "tool not an object", {"tools": ["f"]}, "tools[0]"),
    # Malformed past tool calls
    (CHAT, "call without function", call({"id": "c1", "type": "function"}),
     "messages[1].tool_calls[0].function"),
    (CHAT, "call without name", call({**GOOD_CALL, "function": {"arguments": "{}"}}),
     "messages[1].tool_calls[0].function.name"),
    (CHAT, "call name not a string", call({**GOOD_CALL, "function": {"name": 1,
     "arguments": "{}"}}), "messages[1].tool_calls[0].function.name"),
    (CHAT, "call arguments an object", call({**GOOD_CALL, "function": {"name": "f",
     "arguments": {"a": 1}}}), "messages[1].tool_calls[0].function.arguments"),
    (CHAT, "call arguments a number", call({**GOOD_CALL, "function": {"name": "f",
     "arguments": 1}}), "messages[1].tool_calls[0].function.arguments"),
    (CHAT, "call without arguments", call({**GOOD_CALL, "function": {"name": "f"}}),
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, "call without id", call({"type": "function", "function": GOOD_CALL["function"]}),
     "messages[1].tool_calls[0].id"),
    (CHAT, "call without type", call({"id": "c1", "function": GOOD_CALL["function"]}),
     "messages[1].tool_calls[0].type"),
    (CHAT, "call function a string", call({**GOOD_CALL, "function": "f"}),
     "messages[1].tool_calls[0].function"),
    (CHAT, "call a string", call("f"), "messages[1].tool_calls[0]"),
    (CHAT, "tool_calls not a list", {"messages": [*USER, {"role": "assistant",
     "tool_calls": GOOD_CALL}]}, "messages[1].tool_calls"),
    # Anthropic tools: input_schema is required, and a JSON schema of an object
    (MESSAGES, "tool without input_schema", anthropic_tool(), None),
    (MESSAGES, "input_schema null", anthropic_tool(input_schema=None), None),
    (MESSAGES, "input_schema a string", anthropic_tool(input_schema="object"), None),
    (MESSAGES, "input_schema not of an object", anthropic_tool(input_schema={"type": "string"}),
     None),
    (MESSAGES, "input_schema not a schema", anthropic_tool(input_schema={"type": "object",
     "properties": {"a": {"type": 5}}}), None),
    (MESSAGES, "tool_use in a user turn", {"messages": [{"role": "user", "content": [
     {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, None),
]  # fmt: skip


def post(http: httpx.Client, path: str, change: dict[str, Any]) -> httpx.Response:
    # json.dumps writes a lone surrogate as its \\u escape (ensure_ascii), as a client does.
    body = json.dumps({**BASE[path], **change})
    return http.post(path, content=body, headers={"content-type": "application/json"})


# What OpenAI's validation answers in ``code``; null for a refusal it has no code for.
VALIDATION_CODES = {
    None, "missing_required_parameter", "invalid_type", "invalid_value", "empty_array",
    "integer_below_min_value", "integer_above_max_value",
    "decimal_below_min_value", "decimal_above_max_value",
}  # fmt: skip


def assert_400(response: httpx.Response, path: str, param: str | None) -> None:
    """A 400 in the API's error shape: OpenAI's with ``param`` and one of its validation
    codes or null, or Anthropic's on /v1/messages."""
    assert response.status_code == 400, response.text
    body = response.json()
    if path == MESSAGES:
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
        return
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] in VALIDATION_CODES
    assert error["param"] == param, error["message"]


@pytest.mark.parametrize(("path", "change", "param"), int_cases())
def test_integers_past_int64_are_400s(http, path, change, param):
    response = post(http, path, change)
    if param == "prompt":  # a union (text or ids): its first member's location comes first
        assert response.status_code == 400 and response.json()["error"]["param"].startswith(param)
    else:
        assert_400(response, path, param)


def named(cases: list[tuple[str, str, dict[str, Any], str | None]]) -> list[Any]:
    return [pytest.param(path, change, param, id=f"{path} {name}")
            for path, name, change, param in cases]  # fmt: skip


@pytest.mark.parametrize(("path", "change", "param"), named(SURROGATE_CASES))
def test_lone_surrogates_are_400s(http, path, change, param):
    assert_400(post(http, path, change), path, param)


@pytest.mark.parametrize(("path", "change", "param"), named(SHAPE_CASES))
def test_malformed_messages_and_tools_are_400s(http, path, change, param):
    assert_400(post(http, path, change), path, param)


@pytest.mark.parametrize(
    ("path", "change"),
    [
        (CHAT, {"max_tokens": 2**63 - 1, "seed": -(2**63), "stop_token_ids": [2**63 - 1]}),
        (CHAT, {"max_completion_tokens": 2**63 - 1, "seed": 2**63 - 1}),
        (COMPLETIONS, {"max_tokens": 2**63 - 1, "seed": 2**63 - 1, "best_of": 1}),
        (COMPLETIONS, {"prompt": [104.0, 105], "max_tokens": 2}),  # an integral float is an id
        (MESSAGES, {"max_tokens": 2**63 - 1,
                    "thinking": {"type": "enabled", "budget_tokens": 2**63 - 1}}),
        (CHAT, {"messages": [{"role": "user", "content": "a\U0001f600b \u00e9"}]}),  # pairs
        (CHAT, {**tool({"type": "object", "properties": {"a": {"type": "string"}},
                        "required": ["a"], "$defs": {"x": {"type": "integer"}}}),
                **call(GOOD_CALL)}),
        (CHAT, {"messages": [*call(GOOD_CALL)["messages"],
                             {"role": "tool", "tool_call_id": "c1", "content": "42"}]}),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}),  # no parameters
        (MESSAGES, anthropic_tool(input_schema={"type": "object",
                                                "properties": {"a": {"type": "string"}}})),
    ],
)  # fmt: skip
def test_the_edges_are_still_served(http, path, change):
    response = post(http, path, change)
    assert response.status_code == 200, response.text


def test_the_error_code_is_openais(server, http):
    """A string where OpenAI has a code for the error, null elsewhere."""

    def code(path: str, change: dict[str, Any]) -> str | None:
        return post(http, path, change).json()["error"]["code"]

    codes: dict[Any, str | None] = {
        "n 0": code(CHAT, {"n": 0}),
        "max_tokens 2**63": code(COMPLETIONS, {"max_tokens": 2**63}),
        "no content": code(CHAT, {"messages": [{"role": "user"}]}),
        404: code(CHAT, {"model": "gpt-4"}),
    }
    wrong_key = {"Authorization": f"Bearer not-{API_KEY}"}
    unauthorised = httpx.post(f"{server.base_url}{CHAT}", json=BASE[CHAT], headers=wrong_key)
    assert unauthorised.status_code == 401
    codes[401] = unauthorised.json()["error"]["code"]
    assert codes == {
        "n 0": "integer_below_min_value", "max_tokens 2**63": "integer_above_max_value",
        "no content": None, 404: "model_not_found", 401: "invalid_api_key",
    }  # fmt: skip
