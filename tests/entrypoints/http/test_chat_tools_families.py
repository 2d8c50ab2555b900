"""/v1/chat/completions on GLM-4.5's, MiniMax-M2's and Kimi-K2's own chat templates: each
resolved at start-up (``resolve_chat_parser``, as http/app.py does) to its tool-call format
and reasoning dialect, then a reply in that format - reasoning, an answer, two calls -
read into the same message streamed (at several chunk sizes) and not."""

from __future__ import annotations

import json
import logging

import pytest

from atom_core.entrypoints.http.openai.chat import resolve_chat_parser
from tests.entrypoints.http.asgi_app import make_app, post, sse_events
from tests.entrypoints.http.scripted_engine import ScriptedEngine
from tests.entrypoints.http.test_chat_tools import TOOLS, USER, accumulate
from tests.parsing.shared_templates import template_path

REASONING = "Two lookups: the weather in Paris, then the time in Rome (a < b is no tag)."
ANSWER = "I will look both up."
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Rome"})]


def glm_call(name: str, args: dict) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                    for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def minimax_calls() -> str:
    invokes = "".join(
        f'<invoke name="{name}">\n'
        + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args.items())
        + "</invoke>\n"
        for name, args in CALLS)
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


def kimi_calls() -> str:
    entries = "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
        f"{json.dumps(args)}<|tool_call_end|>" for i, (name, args) in enumerate(CALLS))
    return f"<|tool_calls_section_begin|>{entries}<|tool_calls_section_end|>"


# template -> (format, dialect as resolved, the reply, the reasoning it carries). Kimi-K2's
# template names no dialect: a reply's inline <think> would still be read as reasoning.
DETECTED, FALLBACK = "think (detected", "think (the chat template names no reasoning dialect"
FAMILIES = {
    "glm4_5": ("glm", DETECTED, f"<think>{REASONING}</think>\n{ANSWER}\n"
               + "\n".join(glm_call(n, a) for n, a in CALLS), REASONING),
    # MiniMax-M2's prompt leaves the reply inside the reasoning: no opening tag.
    "minimax_m2": ("minimax", DETECTED,
                   f"{REASONING}\n</think>\n\n{ANSWER}\n" + minimax_calls(), f"{REASONING}\n"),
    "kimi_k2": ("kimi", FALLBACK, ANSWER + kimi_calls(), ""),
    "kimi_k2_thinking": ("kimi", DETECTED, f"<think>{REASONING}</think>{ANSWER}" + kimi_calls(),
                         REASONING),
}


@pytest.fixture(params=sorted(FAMILIES))
def family(request, caplog):
    name = request.param
    fmt, dialect, reply, reasoning = FAMILIES[name]
    template = template_path(name).read_text()

    engines = []

    def app(chunk: int):
        engines.append(ScriptedEngine(reply, chunk=chunk, chat_template=template))
        parser, encoder = resolve_chat_parser(engines[-1], None)
        return make_app(engines[-1], parser=parser, encoder=encoder)

    with caplog.at_level(logging.INFO):
        app(1)
    assert f"tool-call format: {fmt} (detected in the chat template)" in caplog.text
    assert f"reasoning dialect: {dialect}" in caplog.text
    return name, app, reasoning, engines


def test_calls_and_reasoning_stream_as_they_read_whole(family):
    name, app, reasoning, engines = family
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 1000}  # chunks count as tokens
    for chunk in (1, 7, 100_000):
        r = post(app(chunk), "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert "get_weather" in engines[-1].prompts[0]  # the template declared the tools
        choice = r.json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in message["tool_calls"]]
        assert calls == CALLS
        assert (message.get("reasoning_content") or "") == reasoning
        assert message["content"].strip() == ANSWER
        if name.startswith("kimi"):  # the model's own ids are the calls' ids
            ids = [c["id"] for c in message["tool_calls"]]
            assert ids == ["functions.get_weather:0", "functions.get_time:1"]
        got = accumulate(sse_events(post(app(chunk), "/v1/chat/completions",
                                         {**body, "stream": True})))
        assert got["content"] == message["content"]
        assert got["reasoning"] == (message.get("reasoning_content") or "")
        assert got["finish"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        if name.startswith("kimi"):
            assert [c["id"] for c in got["calls"]] == ids
