"""Tool calls and reasoning end to end: the real server, engine, tokenizer and SDKs.

The model is ReplayForCausalLM (tests/replay_plugin, installed into a temporary directory
and put on the server's PYTHONPATH): it replays the script a test writes before each
request, through the real tokenizer (byte-level), engine and detokenizer. Its tokenizer
carries Qwen3's chat template, so ``--tool-call-parser auto`` resolves hermes + think with
the enable_thinking switch. Requests are sent one at a time (the replay model's rule).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

from atom_core.entrypoints.server_process import ServerProcess, free_port
from atom_core.testing.tiny_models import build_tokenizer
from tests.parsing.shared_templates import template_path
from tests.plugin_dists import pip_install
from tests.replay_plugin.atom_replay_model.checkpoint import write_replay_model, write_script

pytestmark = pytest.mark.slow

REPLAY_PLUGIN = Path(__file__).parents[1] / "replay_plugin"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
     "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                    "required": ["tz"]}}},
]
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]
USER = [{"role": "user", "content": "What is the weather in Paris, and the time in Rome?"}]
REASONING = "Two lookups: weather for Paris, time for Rome. Note a < b is not markup."
EXPLANATION = "I asked for the weather in Paris and the time in Rome; answers follow."
REPLY = (
    f"<think>\n{REASONING}\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Rome"}}\n</tool_call>\n'
    f"{EXPLANATION}"
)


class Replay:
    """The server, and the script its model replays next."""

    def __init__(self, server: ServerProcess, script: Path, tokenizer) -> None:
        self.server, self.script, self.tokenizer = server, script, tokenizer

    def say(self, text: str) -> None:
        write_script(self.script, self.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    qwen3 = template_path("qwen3").read_text()
    root = tmp_path_factory.mktemp("replay")
    site = root / "site"
    pip_install(REPLAY_PLUGIN, site)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = qwen3
    script = root / "script.json"
    write_script(script, [])
    model = write_replay_model(root / "model", tokenizer, script=script)
    with pytest.MonkeyPatch.context() as mp:  # the server process inherits it
        paths = filter(None, [str(site), os.environ.get("PYTHONPATH")])
        mp.setenv("PYTHONPATH", os.pathsep.join(paths))
        server = ServerProcess(model, "--max-model-len", "4096", "--served-model-name", "replay",
                               log=root / "server.log")
    try:
        server.wait_ready()
        yield Replay(server, script, tokenizer)
    finally:
        server.stop()


@pytest.fixture
def oai(replay):
    return openai.OpenAI(base_url=f"{replay.server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(replay):
    return anthropic.Anthropic(base_url=replay.server.base_url, api_key="unused", max_retries=0)


def test_start_up_log_names_the_resolved_format(replay):
    log = replay.server.log_path.read_text()
    assert "tool-call format: hermes" in log and "reasoning dialect: think" in log
    assert "thinking switch: enable_thinking=False" in log


def test_openai_sdk_accumulates_streamed_calls_into_the_non_streamed_ones(replay, oai):
    replay.say(REPLY)
    full = oai.chat.completions.create(model="replay", messages=USER, tools=TOOLS, max_tokens=1000)
    replay.say(REPLY)
    stream = oai.chat.completions.create(model="replay", messages=USER, tools=TOOLS,
                                         max_tokens=1000, stream=True)
    content, reasoning, calls, order, finish = "", "", {}, [], None
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            reasoning += extra["reasoning_content"]
            order.append("reasoning")
        if delta.content:
            content += delta.content
            order.append("content")
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
            order.append("tool_calls")
        finish = choice.finish_reason or finish

    message = full.choices[0].message
    assert full.choices[0].finish_reason == finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Rome"})]
    streamed = [calls[i] for i in sorted(calls)]
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert all(c["id"].startswith("call_") for c in streamed)
    assert message.model_extra["reasoning_content"] == reasoning == f"\n{REASONING}\n"
    assert content == message.content and content.endswith(EXPLANATION)
    # reasoning first, the calls, then the explanation after them
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert runs[0] == "reasoning" and runs[-1] == "content" and "tool_calls" in runs
    assert max(i for i, k in enumerate(order) if k == "tool_calls") < len(order) - 1


def test_without_parallel_calls_both_apis_return_the_first_call_only(replay, oai, claude):
    # The reply holds two calls; the client allowed one. Streamed and not, the same one.
    kw = dict(model="replay", messages=USER, tools=TOOLS, max_tokens=1000,
              parallel_tool_calls=False)
    replay.say(REPLY)
    full = oai.chat.completions.create(**kw)
    replay.say(REPLY)
    streamed = {}
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or ():
            streamed[tc.index] = streamed.get(tc.index, "") + (tc.function.arguments or "")
    calls = full.choices[0].message.tool_calls
    got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert got == [("get_weather", {"city": "Paris"})]
    assert streamed == {0: calls[0].function.arguments}
    assert full.choices[0].message.content.endswith(EXPLANATION)
    replay.say(REPLY)
    one_at_a_time = {"type": "auto", "disable_parallel_tool_use": True}
    message = claude.messages.create(model="replay", max_tokens=1000, messages=USER,
                                     tools=ANTHROPIC_TOOLS, tool_choice=one_at_a_time)
    got = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert got == [("get_weather", {"city": "Paris"})]


def test_anthropic_message_stream_matches_the_message(replay, claude):
    kw = dict(model="replay", max_tokens=1000, messages=USER, tools=ANTHROPIC_TOOLS)
    replay.say(REPLY)
    full = claude.messages.create(**kw)
    replay.say(REPLY)
    with claude.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"thinking", "text", "input_json"} <= set(kinds)
    assert [b.type for b in full.content] == [b.type for b in final.content] == [
        "thinking", "text", "tool_use", "tool_use", "text"]
    for got, want in zip(final.content, full.content):
        if got.type == "tool_use":
            assert (got.name, got.input) == (want.name, want.input)
            assert got.id.startswith("toolu_")
        elif got.type == "text":
            assert got.text == want.text
        else:
            assert got.thinking == want.thinking == f"\n{REASONING}\n"
    assert full.content[-1].text.endswith(EXPLANATION)
    inputs = [b.input for b in full.content if b.type == "tool_use"]
    assert inputs == [{"city": "Paris"}, {"tz": "Europe/Rome"}]
    assert final.stop_reason == full.stop_reason == "tool_use"
    reply_tokens = len(replay.tokenizer.encode(REPLY)) + 1
    assert final.usage.output_tokens == full.usage.output_tokens == reply_tokens


def test_plain_answers_and_stop_reasons(replay, claude, oai):
    replay.say("Just text, no tools: if (a < b) return;\n")
    m = claude.messages.create(model="replay", max_tokens=1000, messages=USER)
    assert [b.type for b in m.content] == ["text"] and m.stop_reason == "end_turn"
    assert m.content[0].text == "Just text, no tools: if (a < b) return;\n"
    replay.say("one two three four")
    m = claude.messages.create(model="replay", max_tokens=1000, messages=USER,
                               stop_sequences=["three"])
    expected = ("stop_sequence", "three", "one two ")
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == expected
    replay.say("one two three four")
    m = claude.messages.create(model="replay", max_tokens=5, messages=USER)
    assert (m.stop_reason, m.content[0].text) == ("max_tokens", "one t")
    # no tools declared: tool_choice none semantics, the markup read and not dispatched
    replay.say(REPLY)
    r = oai.chat.completions.create(model="replay", messages=USER, max_tokens=1000)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content.endswith(EXPLANATION)


def test_anthropic_errors_from_the_real_server(replay):
    import httpx

    body = {"model": "replay", "messages": USER}
    r = httpx.post(f"{replay.server.base_url}/v1/messages", json=body)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


def test_an_unknown_tool_call_parser_is_refused_before_the_engine_starts(tmp_path):
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "atom_core.entrypoints.server_runtime", "--model", str(tmp_path),
         "--server-port", str(port), "--tool-call-parser", "nope"],
        capture_output=True, text=True, timeout=120,
    )
    # tmp_path holds no model at all: the flag was refused before anything read it.
    assert proc.returncode == 1, proc.stderr
    assert "unknown tool-call parser 'nope'" in proc.stderr
