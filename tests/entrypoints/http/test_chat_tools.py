"""/v1/chat/completions through the ResponseParser: tool_calls, reasoning_content and the
thinking switch, on a scripted engine and Qwen3's real chat template (hermes + think)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from atom_core.entrypoints.http.openai.chat import chat_encoder_for, effective_tool_choice
from atom_core.errors import ConfigError, InvalidRequestError
from atom_core.parsing.chat_encoders import JinjaChatEncoder
from atom_core.parsing.response import check_parser_names
from tests.entrypoints.http.asgi_app import async_client, make_app, post, sse_events
from tests.entrypoints.http.scripted_engine import (
    MODEL,
    ScriptedEngine,
)
from tests.parsing.shared_templates import template_path
from tests.tiny_tokenizer import CHAT_TEMPLATE

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
     "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
USER = [{"role": "user", "content": "Weather in Paris and the time in Rome?"}]
REASONING = 'Two tools; note that "a < b" and <tool_call> in prose are not calls.'
EXPLANATION = "\nI asked for both; the results follow.\n"
REPLY = (
    f"<think>{REASONING}</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Rome"}}\n</tool_call>'
    f"{EXPLANATION}"
)


@pytest.fixture(scope="module")
def qwen3() -> str:
    return template_path("qwen3").read_text()


def engine(qwen3: str, reply: str = REPLY, chunk: int = 3) -> ScriptedEngine:
    return ScriptedEngine(reply, chunk=chunk, chat_template=qwen3)


def accumulate(events: list[Any]) -> dict[str, Any]:
    """What a client accumulating the stream by index ends up with."""
    content, reasoning, calls, finish = "", "", {}, None
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for tc in delta.get("tool_calls") or ():
                call = calls.setdefault(tc["index"], {"arguments": ""})
                fn = tc.get("function") or {}
                if "id" in tc:
                    assert "id" not in call, "a call's id is sent once"
                    call.update(id=tc["id"], type=tc["type"], name=fn["name"])
                    assert fn["arguments"] == "" and call["arguments"] == "", (
                        "the name precedes the arguments"
                    )
                else:
                    assert "name" not in fn
                call["arguments"] += fn.get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {"content": content, "reasoning": reasoning, "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}


def full_message(qwen3: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    r = post(make_app(engine(qwen3, **kw)), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_tool_calls_reasoning_and_the_answer_after_them(qwen3):
    choice = full_message(qwen3, {"messages": USER, "tools": TOOLS})
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == REASONING
    # Byte for byte but for the markup: the whitespace around the calls is the answer's.
    assert message["content"] == "\n\n" + EXPLANATION
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    arguments = [json.loads(c["function"]["arguments"]) for c in calls]
    assert arguments == [{"city": "Paris"}, {"tz": "Europe/Rome"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("chunk", [1, 2, 5, 64, 100_000])
def test_stream_agrees_with_non_stream_byte_for_byte(qwen3, chunk):
    body = {"messages": USER, "tools": TOOLS}
    whole = full_message(qwen3, body, chunk=chunk)
    r = post(make_app(engine(qwen3, chunk=chunk)), "/v1/chat/completions", {**body, "stream": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    got = accumulate(events)
    message = whole["message"]
    assert got["content"] == message["content"]
    assert got["reasoning"] == message["reasoning_content"]
    assert got["finish"] == whole["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got["calls"])
    # Reasoning first, then the calls, then the explanation after them.
    kinds = []
    for e in events[:-1]:
        delta = e["choices"][0]["delta"]
        kinds_here = ("reasoning_content", "tool_calls", "content")
        kind = next((k for k in kinds_here if delta.get(k)), None)
        if kind and (not kinds or kinds[-1] != kind):
            kinds.append(kind)
    assert kinds[0] == "reasoning_content" and kinds[-1] == "content" and "tool_calls" in kinds


def test_a_request_without_tools_reads_as_tool_choice_none(qwen3):
    choice = full_message(qwen3, {"messages": USER})
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
    assert EXPLANATION in choice["message"]["content"]
    assert "<tool_call>" not in choice["message"]["content"]  # the format is still read
    body = {"messages": USER, "stream": True}
    events = sse_events(post(make_app(engine(qwen3)), "/v1/chat/completions", body))
    got = accumulate(events)
    assert got["calls"] == [] and got["content"] == choice["message"]["content"]


def test_named_tool_choice_dispatches_only_that_tool(qwen3):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = full_message(qwen3, {"messages": USER, "tools": TOOLS, "tool_choice": named})
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]


def test_tool_choice_none_suppresses_dispatch_not_the_answer(qwen3):
    choice = full_message(qwen3, {"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert choice["message"]["tool_calls"] is None and choice["finish_reason"] == "stop"
    assert EXPLANATION in choice["message"]["content"]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "x"}}]
)
def test_requiring_a_call_without_tools_is_a_400(qwen3, tool_choice):
    body = {"messages": USER, "tool_choice": tool_choice}
    r = post(make_app(engine(qwen3)), "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_named_tool_that_is_not_declared_is_a_400(qwen3):
    named = {"type": "function", "function": {"name": "nope"}}
    body = {"messages": USER, "tools": TOOLS, "tool_choice": named}
    r = post(make_app(engine(qwen3)), "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_effective_tool_choice():
    assert effective_tool_choice(None, None) == "none"
    assert effective_tool_choice([], "auto") == "none"
    assert effective_tool_choice(TOOLS, None) is None
    assert effective_tool_choice(TOOLS, "required") == "required"
    with pytest.raises(InvalidRequestError, match="declares no tools"):
        effective_tool_choice(None, {"type": "any"})
    with pytest.raises(InvalidRequestError, match="must be 'auto'"):
        effective_tool_choice(None, "sometimes")


@pytest.mark.parametrize(
    "knob",
    [{"enable_thinking": False}, {"thinking": {"type": "disabled"}}, {"thinking": False},
     {"chat_template_kwargs": {"enable_thinking": False}}],
)
def test_thinking_off_is_answered_in_the_prompt(qwen3, knob):
    eng = engine(qwen3, reply="Hi there.")
    r = post(make_app(eng), "/v1/chat/completions", {"messages": USER, **knob})
    assert r.status_code == 200
    assert eng.prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r.json()["choices"][0]["message"]["content"] == "Hi there."


@pytest.mark.parametrize("knob", [
    {}, {"thinking": {"type": "enabled"}}, {"enable_thinking": True},
    {"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": True}},
])
def test_thinking_on_or_absent_leaves_the_prompt_open(qwen3, knob):
    eng = engine(qwen3, reply="Hi.")
    post(make_app(eng), "/v1/chat/completions", {"messages": USER, **knob})
    assert eng.prompts[0].endswith("<|im_start|>assistant\n")


def test_thinking_of_a_bad_shape_is_a_400(qwen3):
    body = {"messages": USER, "thinking": {"type": "on"}}
    r = post(make_app(engine(qwen3)), "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking"


@pytest.mark.parametrize("stream", [False, True])
def test_without_a_template_switch_disabled_thinking_is_withheld(stream):
    # The tiny ChatML template has no switch: the reasoning is separated, then withheld.
    eng = ScriptedEngine("<think>musing</think>The answer.", chat_template=CHAT_TEMPLATE)
    app = make_app(eng)
    body = {"messages": USER, "enable_thinking": False, "stream": stream}
    r = post(app, "/v1/chat/completions", body)
    if stream:
        got = accumulate(sse_events(r))
        assert (got["content"], got["reasoning"]) == ("The answer.", "")
    else:
        message = r.json()["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == ("The answer.", None)
    # Not asked: the model's default stands, and its reasoning is delivered.
    scripted = ScriptedEngine("<think>musing</think>The answer.", chat_template=CHAT_TEMPLATE)
    r = post(make_app(scripted), "/v1/chat/completions", {"messages": USER})
    assert r.json()["choices"][0]["message"]["reasoning_content"] == "musing"


def test_the_resolved_parser_is_the_templates(qwen3):
    encoder = chat_encoder_for(engine(qwen3))
    assert isinstance(encoder, JinjaChatEncoder) and encoder.source == qwen3


def test_the_openai_sdk_accumulates_the_same_calls(qwen3):
    async def go() -> tuple[Any, Any]:
        app = make_app(engine(qwen3, chunk=4))
        async with async_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
            )
            full = await client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
            stream = await client.chat.completions.create(
                model=MODEL, messages=USER, tools=TOOLS, stream=True
            )
            calls: dict[int, dict[str, str]] = {}
            content = ""
            async for chunk in stream:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for tc in delta.tool_calls or ():
                    call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            return full, (content, [calls[i] for i in sorted(calls)])

    full, (content, calls) = asyncio.run(go())
    message = full.choices[0].message
    assert content == message.content
    assert calls == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]
    assert full.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == REASONING


def test_parser_names_are_checked_before_anything_loads():
    check_parser_names("auto", "auto")
    check_parser_names("hermes", "think")
    check_parser_names("none", "none")
    with pytest.raises(ConfigError, match="unknown tool-call parser 'nope'"):
        check_parser_names("nope", "auto")
    with pytest.raises(ConfigError, match="unknown reasoning parser 'nope'"):
        check_parser_names("auto", "nope")
