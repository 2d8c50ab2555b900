"""gpt-oss's harmony through /v1/chat/completions: a scripted engine behind gpt-oss's real
chat template, so the start-up resolves the harmony format and dialect from it; tool
calls, reasoning and the answer, streamed and not, and a tool turn rendered back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.entrypoints.http.asgi_app import make_app, post, sse_events
from tests.entrypoints.http.scripted_engine import ScriptedEngine
from tests.entrypoints.http.test_chat_tools import accumulate
from tests.parsing.shared_templates import template_path

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
REASONING = 'The user wants the weather; "a < b" and <|channel|> in prose are not markup.'
PREAMBLE = "Let me check."
CALL_REPLY = (
    f"<|channel|>analysis<|message|>{REASONING}<|end|>"
    f"<|start|>assistant<|channel|>commentary<|message|>{PREAMBLE}<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}'  # <|call|> stopped the request: not in the text
)
ANSWER = "It is sunny in Paris, 21 °C."
ANSWER_REPLY = (
    "<|channel|>analysis<|message|>The tool said sunny.<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
)


@pytest.fixture(scope="module")
def gpt_oss() -> str:
    return template_path("gpt_oss").read_text()


def reply(gpt_oss: str, text: str, body: dict[str, Any], chunk: int, stream: bool):
    eng = ScriptedEngine(text, chunk=chunk, chat_template=gpt_oss)
    body = {**body, "stream": stream, "max_tokens": 1000}  # the engine counts chunks
    r = post(make_app(eng), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return eng, r


@pytest.mark.parametrize("chunk", [1, 3, 7, 100_000])
def test_a_call_with_reasoning_and_a_preamble_streams_as_it_reads_whole(gpt_oss, chunk):
    body = {"messages": USER, "tools": TOOLS}
    eng, r = reply(gpt_oss, CALL_REPLY, body, chunk, stream=False)
    assert eng.prompts[0].endswith("<|start|>user<|message|>Weather in Paris?<|end|>"
                                   "<|start|>assistant")
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (message["reasoning_content"], message["content"]) == (REASONING, PREAMBLE)
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    _, r = reply(gpt_oss, CALL_REPLY, body, chunk, stream=True)
    got = accumulate(sse_events(r))
    assert (got["reasoning"], got["content"], got["finish"]) == (
        REASONING, PREAMBLE, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        ("get_weather", call["function"]["arguments"])]


@pytest.mark.parametrize("stream", [False, True])
def test_the_tool_turn_renders_back_and_the_answer_is_read(gpt_oss, stream):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    eng, r = reply(gpt_oss, ANSWER_REPLY, {"messages": messages, "tools": TOOLS}, 5, stream)
    # The past call as harmony writes it: arguments as an object, not a quoted string.
    assert eng.prompts[0].endswith(
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>"Sunny, 21 C"<|end|><|start|>assistant'
    )
    if stream:
        got = accumulate(sse_events(r))
        assert (got["reasoning"], got["content"], got["calls"], got["finish"]) == (
            "The tool said sunny.", ANSWER, [], "stop")
    else:
        choice = r.json()["choices"][0]
        message = choice["message"]
        assert (message["reasoning_content"], message["content"]) == (
            "The tool said sunny.", ANSWER)
        assert message["tool_calls"] is None and choice["finish_reason"] == "stop"


def test_the_analysis_of_a_tool_turn_is_kept_as_thinking(gpt_oss):
    # The template keeps a tool turn's analysis (under "thinking") until a final answer.
    call = {"id": "c", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}
    messages = [*USER, {"role": "assistant", "content": None, "thinking": "Need Oslo.",
                        "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c", "content": "Rain"}]
    eng, _ = reply(gpt_oss, ANSWER_REPLY, {"messages": messages, "tools": TOOLS}, 5, False)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need Oslo.<|end|>"
            "<|start|>assistant to=functions.get_weather") in eng.prompts[0]
