"""/v1/messages (Anthropic Messages API) on a scripted engine with Qwen3's real template."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import pytest

from atom_core.entrypoints.http.anthropic.messages import MessageBlocks, chat_messages
from atom_core.entrypoints.http.anthropic.protocol import MessagesRequest
from atom_core.parsing.events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from tests.entrypoints.http.asgi_app import make_app, post
from tests.entrypoints.http.scripted_engine import (
    MODEL,
    ScriptedEngine,
)
from tests.parsing.shared_templates import template_path
from tests.tiny_tokenizer import CHAT_TEMPLATE

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}},
    {"name": "get_time",
     "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}},
]
USER = [{"role": "user", "content": "Weather in Paris and the time in Rome?"}]
REASONING = "Two tools, then explain."
EXPLANATION = "\nI asked for both; the results follow."
REPLY = (
    f"<think>{REASONING}</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Rome"}}\n</tool_call>'
    f"{EXPLANATION}"
)
BODY = {"model": MODEL, "max_tokens": 200, "messages": USER, "tools": TOOLS}


@pytest.fixture(scope="module")
def qwen3() -> str:
    return template_path("qwen3").read_text()


def app_for(template: str, reply: str = REPLY, chunk: int = 3, **kw: Any):
    eng = ScriptedEngine(reply, chunk=chunk, chat_template=template, **kw)
    return make_app(eng), eng


def events_of(response) -> list[tuple[str, dict[str, Any]]]:
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.content.split(b"\n\n")
    assert frames[-1] == b""
    out = []
    for frame in frames[:-1]:
        name, data = frame.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:].decode()
        out.append((payload["type"], payload))
    return out


def fold(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Accumulate a stream's blocks as a client does."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for name, e in events:
        if name == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif name == "content_block_delta":
            d, block = e["delta"], blocks[e["index"]]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
        elif name == "content_block_stop" and e["index"] in partial:
            blocks[e["index"]]["input"] = json.loads(partial.pop(e["index"]))
    return blocks


def test_non_streamed_message(qwen3):
    app, eng = app_for(qwen3)
    r = post(app, "/v1/messages", BODY)
    assert r.status_code == 200, r.text
    m = r.json()
    assert m["id"].startswith("msg_") and m["type"] == "message" and m["role"] == "assistant"
    assert m["model"] == MODEL and m["stop_reason"] == "tool_use" and m["stop_sequence"] is None
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use", "tool_use", "text"]
    thinking, lead, weather, time_, tail = m["content"]
    assert thinking["thinking"] == REASONING
    assert lead["text"] == "\n\n" and tail["text"] == EXPLANATION
    assert (weather["name"], weather["input"]) == ("get_weather", {"city": "Paris"})
    assert (time_["name"], time_["input"]) == ("get_time", {"tz": "Europe/Rome"})
    assert weather["id"].startswith("toolu_") and weather["id"] != time_["id"]
    assert m["usage"]["input_tokens"] > 0 and m["usage"]["output_tokens"] > 0
    # the tools reached the template in OpenAI's shape
    assert '"name": "get_weather"' in eng.prompts[0] and "<tools>" in eng.prompts[0]


@pytest.mark.parametrize("chunk", [1, 2, 7, 100_000])
def test_stream_events_in_order_and_folding_to_the_message(qwen3, chunk):
    full = post(app_for(qwen3, chunk=chunk)[0], "/v1/messages", BODY).json()
    streamed = post(app_for(qwen3, chunk=chunk)[0], "/v1/messages", {**BODY, "stream": True})
    events = events_of(streamed)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["id"].startswith("msg_")
    # blocks: start, deltas, stop, one at a time
    open_index = None
    for name, e in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            open_index = e["index"]
        elif name == "content_block_delta":
            assert e["index"] == open_index
        else:
            assert name == "content_block_stop" and e["index"] == open_index
            open_index = None
    assert open_index is None
    # a tool_use block opens with its input: start {} then the whole JSON, then stop
    for i, (name, e) in enumerate(events):
        if name == "content_block_start" and e["content_block"]["type"] == "tool_use":
            assert e["content_block"]["input"] == {}
            assert events[i + 1][1]["delta"]["type"] == "input_json_delta"
            assert events[i + 2][0] == "content_block_stop"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == full["usage"]["output_tokens"]
    blocks = fold(events)
    for b in blocks:
        if b["type"] == "tool_use":
            b["id"] = "x"
    for b in full["content"]:
        if b["type"] == "tool_use":
            b["id"] = "x"
    assert blocks == full["content"]


def test_thinking_disabled_is_answered_in_the_prompt(qwen3):
    app, eng = app_for(qwen3, reply="Hello.")
    r = post(app, "/v1/messages", {**BODY, "thinking": {"type": "disabled"}})
    assert eng.prompts[0].endswith("<think>\n\n</think>\n\n")
    assert r.json()["content"] == [{"type": "text", "text": "Hello."}]
    post(app, "/v1/messages", {**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    post(app, "/v1/messages", BODY)
    assert eng.prompts[1].endswith("<|im_start|>assistant\n") and eng.prompts[2] == eng.prompts[1]


@pytest.mark.parametrize("stream", [False, True])
def test_without_a_switch_disabled_thinking_blocks_are_withheld(stream):
    # ChatML has no switch: the reasoning is still separated, and its blocks withheld; a
    # reply that was nothing but reasoning ends on an empty text block.
    for reply, content in [("<think>hm</think>Fine.", [{"type": "text", "text": "Fine."}]),
                           ("<think>only musing", [{"type": "text", "text": ""}])]:
        app, _ = app_for(CHAT_TEMPLATE, reply=reply)
        body = {**BODY, "tools": None, "thinking": {"type": "disabled"}, "stream": stream}
        r = post(app, "/v1/messages", body)
        blocks = fold(events_of(r)) if stream else r.json()["content"]
        assert blocks == content
    app, _ = app_for(CHAT_TEMPLATE, reply="<think>hm</think>Fine.")
    blocks = post(app, "/v1/messages", {**BODY, "tools": None}).json()["content"]
    assert blocks == [{"type": "thinking", "thinking": "hm", "signature": ""},
                      {"type": "text", "text": "Fine."}]


def test_tool_choice_none_gives_no_tool_use(qwen3):
    app, _ = app_for(qwen3)
    m = post(app, "/v1/messages", {**BODY, "tool_choice": {"type": "none"}}).json()
    assert m["stop_reason"] == "end_turn"
    assert [b["type"] for b in m["content"]] == ["thinking", "text"]
    assert m["content"][1]["text"].endswith(EXPLANATION)


def test_tool_choice_tool_dispatches_only_that_one(qwen3):
    app, _ = app_for(qwen3)
    body = {**BODY, "tool_choice": {"type": "tool", "name": "get_time"}}
    m = post(app, "/v1/messages", body).json()
    assert [b["name"] for b in m["content"] if b["type"] == "tool_use"] == ["get_time"]


def test_stop_sequence_and_max_tokens(qwen3):
    app, eng = app_for(qwen3, reply="one two three four")
    m = post(app, "/v1/messages", {**BODY, "stop_sequences": ["three"]}).json()
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "three")
    assert m["content"] == [{"type": "text", "text": "one two "}]
    assert eng.params[0].stop_strings == ["three"]
    m = post(app, "/v1/messages", {**BODY, "max_tokens": 2}).json()
    assert (m["stop_reason"], m["stop_sequence"]) == ("max_tokens", None)
    m = post(app, "/v1/messages", BODY).json()
    assert m["stop_reason"] == "end_turn"


def test_sampling_fields_reach_the_engine(qwen3):
    app, eng = app_for(qwen3, reply="ok")
    post(app, "/v1/messages",
         {**BODY, "temperature": 0.2, "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"}})
    p = eng.params[0]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 0.9, 5, 200)


def test_blocks_of_past_turns_reach_the_template(qwen3):
    body = {
        **BODY,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            *USER,
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "need weather", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "text", "text": "And now?"},
            ]},
        ],
    }
    app, eng = app_for(qwen3, reply="ok")
    assert post(app, "/v1/messages", body).status_code == 200
    prompt = eng.prompts[0]
    assert "Be brief." in prompt
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert f"<tool_call>\n{call}\n</tool_call>" in prompt
    assert "<tool_response>\nSunny\n</tool_response>" in prompt
    assert prompt.index("Sunny") < prompt.index("And now?")
    messages = chat_messages(MessagesRequest.model_validate(body))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["reasoning_content"] == "need weather"
    assert messages[3]["name"] == "get_weather"


@pytest.mark.parametrize(
    "body, status, kind",
    [
        ({"model": MODEL, "messages": USER}, 400, "invalid_request_error"),  # no max_tokens
        ({**BODY, "model": "claude-nope"}, 404, "not_found_error"),
        ({**BODY, "tool_choice": {"type": "tool"}}, 400, "invalid_request_error"),
        ({**BODY, "tools": None, "tool_choice": {"type": "any"}}, 400, "invalid_request_error"),
        ({**BODY, "thinking": {"type": "sometimes"}}, 400, "invalid_request_error"),
        ({**BODY, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         400, "invalid_request_error"),
        ({**BODY, "messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
         400, "invalid_request_error"),
        ({**BODY, "max_tokens": 0}, 400, "invalid_request_error"),
        ({**BODY, "messages": []}, 400, "invalid_request_error"),
        ({**BODY, "max_tokens": 2**63}, 400, "invalid_request_error"),
        ({**BODY, "tools": [{"name": "f"}]}, 400, "invalid_request_error"),  # no input_schema
        ({**BODY, "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, 400,
         "invalid_request_error"),
        ({**BODY, "tools": [{"name": "f", "input_schema": {"type": "object", "required": 1}}]}, 400,
         "invalid_request_error"),
        ({**BODY, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         400, "invalid_request_error"),
        (b'{"model": "m", "max_tokens": 5, '
         b'"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "invalid_request_error"),
    ],
)
def test_errors_are_anthropic_shaped(qwen3, body, status, kind):
    app, _ = app_for(qwen3)
    r = post(app, "/v1/messages", body)
    assert r.status_code == status, r.text
    e = r.json()
    assert set(e) == {"type", "error"} and e["type"] == "error"
    assert e["error"]["type"] == kind and e["error"]["message"]


def test_bad_json_and_engine_failure(qwen3):
    app, _ = app_for(qwen3)
    r = post(app, "/v1/messages", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    app, _ = app_for(qwen3, error="engine died")
    r = post(app, "/v1/messages", BODY)
    assert r.status_code == 503 and r.json()["error"]["type"] == "api_error"
    events = events_of(post(app, "/v1/messages", {**BODY, "stream": True}))
    assert events[-1][0] == "error" and events[-1][1]["error"]["message"]


def test_message_blocks_open_tool_use_on_arguments():
    blocks = MessageBlocks()
    assert blocks.feed([ToolCallStart(0, "toolu_a", "f")]) == []  # the name alone opens nothing
    out = blocks.feed([ToolCallArguments(0, '{"x": 1}'), ContentDelta("after")])
    kinds = [type(e).__name__ for e in out]
    assert kinds == ["ContentBlockStart", "ContentBlockDelta", "ContentBlockStop",
                     "ContentBlockStart", "ContentBlockDelta"]
    assert blocks.called
    hidden = MessageBlocks(show_thinking=False)
    assert hidden.feed([ReasoningDelta("x")]) == []


def sdk_http_lib() -> Any:
    """The HTTP library the anthropic SDK takes a client of: recent releases use their
    own fork, httpx2, and refuse an httpx client."""
    try:
        import httpx2
    except ImportError:
        import httpx as httpx2
    return httpx2


def test_the_anthropic_sdk_stream_matches_the_message(qwen3):
    async def go():
        app, _ = app_for(qwen3, chunk=5)
        http_lib = sdk_http_lib()
        transport = http_lib.ASGITransport(app)
        async with http_lib.AsyncClient(transport=transport, base_url="http://test") as http:
            client = anthropic.AsyncAnthropic(
                base_url="http://test", api_key="x", http_client=http, max_retries=0
            )
            full = await client.messages.create(**BODY)
            async with client.messages.stream(**BODY) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_message()
            return full, final, kinds

    full, final, kinds = asyncio.run(go())
    assert "input_json" in kinds and "thinking" in kinds and "text" in kinds
    assert [b.type for b in final.content] == [b.type for b in full.content] == [
        "thinking", "text", "tool_use", "tool_use", "text"]
    for got, want in zip(final.content, full.content):
        if got.type == "tool_use":
            assert (got.name, got.input) == (want.name, want.input)
        elif got.type == "text":
            assert got.text == want.text
        else:
            assert got.thinking == want.thinking == REASONING
    assert final.stop_reason == full.stop_reason == "tool_use"
    assert final.usage.output_tokens == full.usage.output_tokens
