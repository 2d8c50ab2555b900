"""Kimi-K2-Thinking's template through the real server, engine and OpenAI SDK (the replay
model of tests/replay_plugin, as test_tools_e2e.py runs Qwen3's): the tool-call format
(kimi) and reasoning dialect (think) resolved at start-up, and a reply whose call markers
are special tokens, as in Kimi's tokenizer - decoded with them kept, so its calls are
read - the same streamed and not."""

from __future__ import annotations

import json
import os

import openai
import pytest

from atom_core.entrypoints.server_process import ServerProcess
from atom_core.testing.tiny_models import build_tokenizer
from tests.entrypoints.test_tools_e2e import REPLAY_PLUGIN, TOOLS, USER
from tests.parsing.shared_templates import template_path
from tests.plugin_dists import pip_install
from tests.replay_plugin.atom_replay_model.checkpoint import write_replay_model, write_script

pytestmark = pytest.mark.slow

MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
REASONING = "Weather for Paris, time for Rome."
ANSWER = "Looking both up."
REPLY = (
    f"<think>{REASONING}</think>{ANSWER}<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
    '<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
    '{"tz": "Europe/Rome"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    site = root / "site"
    pip_install(REPLAY_PLUGIN, site)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(MARKERS, special_tokens=True)
    tokenizer.chat_template = template_path("kimi_k2_thinking").read_text()
    script = root / "script.json"
    write_script(script, tokenizer.encode(REPLY, add_special_tokens=False))
    model = write_replay_model(root / "model", tokenizer, script=script)
    with pytest.MonkeyPatch.context() as mp:  # the server process inherits it
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site),
                                                              os.environ.get("PYTHONPATH")])))
        server = ServerProcess(model, "--max-model-len", "4096", "--served-model-name", "kimi",
                               log=root / "server.log")
    try:
        server.wait_ready()
        yield server, tokenizer
    finally:
        server.stop()


def test_calls_in_special_tokens_are_read_the_same_streamed_and_not(kimi):
    server, tokenizer = kimi
    assert all(len(tokenizer.encode(m, add_special_tokens=False)) == 1 for m in MARKERS)
    log = server.log_path.read_text()
    assert "tool-call format: kimi" in log and "reasoning dialect: think" in log
    assert "decoded with special tokens kept" in log
    oai = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    kw = dict(model="kimi", messages=USER, tools=TOOLS, max_tokens=1000)
    full = oai.chat.completions.create(**kw)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"}),
        ("functions.get_time:1", "get_time", {"tz": "Europe/Rome"})]
    assert message.model_extra["reasoning_content"] == REASONING and message.content == ANSWER
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        for tc in choice.delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += tc.id or ""
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    assert (content, reasoning, finish) == (ANSWER, REASONING, "tool_calls")
    assert [calls[i] for i in sorted(calls)] == [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls]
