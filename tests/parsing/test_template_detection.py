"""Tool-call format, reasoning dialect and thinking switch, read from real vendor templates."""

from __future__ import annotations

import json
import logging
import textwrap

import pytest

from atom_core.errors import ConfigError
from atom_core.parsing.chat_encoders import (
    PROBE_TOOLS,
    JinjaChatEncoder,
    PythonChatEncoder,
    load_chat_encoder,
    render_probe_prompt,
    resolve_thinking_switch,
)
from atom_core.parsing.reasoning_dialects import resolve_dialect
from atom_core.parsing.response import ResponseParser
from atom_core.parsing.tool_detection import (
    check_tool_call_parser,
    resolve_tool_format,
)
from atom_core.plugins import get_registries
from atom_core.registries import NamedRegistry
from tests.parsing.shared_templates import template_path

# template -> (tool-call format, reasoning dialect detected, thinking switch keyword)
EXPECTED = {
    "qwen3": ("hermes", "think", "enable_thinking"),
    "qwen3_v1_0.6b": ("hermes", "think", "enable_thinking"),
    "qwen3_coder": ("qwen", None, None),
    "glm4_5": ("glm", "think", "enable_thinking"),
    "kimi_k2": ("kimi", None, None),
    "kimi_k2_thinking": ("kimi", "think", None),
    "minimax_m2": ("minimax", "think", None),
    "deepseek_v3_1": ("deepseek_v31", "think", "thinking"),
    "deepseek_v3_2_dsml_llamacpp": ("dsml", "think", "enable_thinking"),
    "deepseek_r1": (None, "think", None),
    "smollm2": (None, None, None),
    "gpt_oss": ("harmony", "harmony", None),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_detection_on_every_vendor_template(name):
    enc = load_chat_encoder(template_path(name))
    fmt, dialect, switch = EXPECTED[name]
    assert resolve_tool_format("auto", render_probe_prompt(enc)).name == fmt
    assert resolve_dialect(enc.source).name == dialect
    found = resolve_thinking_switch(enc)
    assert (found.kwarg if found else None) == switch


@pytest.mark.parametrize(
    "name,inside",
    [("deepseek_r1", True), ("minimax_m2", True), ("qwen3", False), ("glm4_5", False),
     ("gpt_oss", False)],
)
def test_whether_output_begins_in_the_channel_is_read_per_request(name, inside):
    enc = load_chat_encoder(template_path(name))
    parser = ResponseParser.resolve(enc)
    prompt = enc.render([{"role": "user", "content": "Hi"}])
    assert parser.reader(prompt=prompt).channel.starts_inside is inside


def test_a_request_that_switches_thinking_off_does_not_begin_inside():
    enc = load_chat_encoder(template_path("deepseek_v3_1"))
    parser = ResponseParser.resolve(enc)
    msgs = [{"role": "user", "content": "Hi"}]
    on = enc.render(msgs, **parser.thinking_switch.kwargs(True))
    off = enc.render(msgs, **parser.thinking_switch.kwargs(False))
    assert parser.reader(prompt=on).channel.starts_inside
    assert not parser.reader(prompt=off).channel.starts_inside
    res = parser.read_whole("Plain answer.", prompt=off)
    assert (res.content, res.reasoning_content) == ("Plain answer.", "")


def test_r1_reasoning_before_the_close_is_reasoning():
    enc = load_chat_encoder(template_path("deepseek_r1"))
    parser = ResponseParser.resolve(enc)
    prompt = enc.render([{"role": "user", "content": "2+2?"}])
    res = parser.read_whole("Add them.\n</think>\n\n4", prompt=prompt)
    assert (res.reasoning_content, res.content, res.tool_calls) == ("Add them.\n", "\n\n4", [])


def test_gpt_oss_reads_its_channels_from_the_start_up_resolution(caplog):
    enc = load_chat_encoder(template_path("gpt_oss"))
    with caplog.at_level(logging.INFO):
        parser = ResponseParser.resolve(enc)
    assert "tool-call format: harmony" in caplog.text
    assert "reasoning dialect: harmony" in caplog.text
    prompt = enc.render([{"role": "user", "content": "Weather in Paris?"}], tools=PROBE_TOOLS)
    reply = (
        "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary"
        ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    )
    res = parser.read_whole(reply, prompt=prompt, tools=PROBE_TOOLS)
    assert (res.reasoning_content, res.content) == ("Look it up.", "")
    assert [(c.name, c.arguments) for c in res.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_unsupported_and_missing_formats_are_logged(caplog):
    # Without a plugin that reads harmony, the gpt-oss template is named, not misread.
    without = NamedRegistry("tool format")
    for entry in get_registries().tool_formats.entries():
        if entry.name != "harmony":
            without.register(entry.name, entry.obj, entry.dist)
    probe = render_probe_prompt(load_chat_encoder(template_path("gpt_oss")))
    choice = resolve_tool_format("auto", probe, without)
    assert choice.format is None
    assert "harmony" in choice.reason and "tool calls arrive as text" in choice.reason
    with caplog.at_level(logging.INFO):
        parser = ResponseParser.resolve(load_chat_encoder(template_path("smollm2")))
    assert parser.tool_format is None
    assert "shows no known tool-call format" in caplog.text
    assert "names no reasoning dialect" in caplog.text


def test_an_unknown_name_is_refused_before_the_template_is_read():
    class Exploding(JinjaChatEncoder):
        def render(self, *a, **k):
            raise AssertionError("rendered")

    with pytest.raises(ConfigError, match="unknown tool-call parser 'mistral-ish'"):
        ResponseParser.resolve(Exploding("{{ messages }}"), tool_call_parser="mistral-ish")
    with pytest.raises(ConfigError):
        check_tool_call_parser("nope")
    check_tool_call_parser("hermes")


def test_an_explicit_name_overrides_the_template():
    encoder = load_chat_encoder(template_path("qwen3"))
    parser = ResponseParser.resolve(encoder, tool_call_parser="qwen")
    assert parser.tool_format.name == "qwen"


ENCODER = textwrap.dedent(
    '''
    import json

    def encode_messages(messages, thinking_mode="thinking", drop_thinking=True):
        out = []
        for m in messages:
            out.append(m["role"] + ":" + m["content"])
            if m.get("tools"):
                out.append("TOOLS " + json.dumps(m["tools"]))
            for c in m.get("tool_calls") or ():
                f = c["function"]
                args = f["arguments"]
                args = args if isinstance(args, str) else json.dumps(args)
                out.append('<｜DSML｜function_calls>\\n<｜DSML｜invoke name="'
                           + f["name"] + '">' + args)
        out.append("assistant:" + ("<think>" if thinking_mode == "thinking" else "</think>"))
        return "\\n".join(out)
    '''
)


def test_a_model_side_python_encoder(tmp_path):
    enc_dir = tmp_path / "model" / "encoding"
    enc_dir.mkdir(parents=True)
    (enc_dir / "encoding_fake.py").write_text(ENCODER)
    enc = load_chat_encoder(tmp_path / "model")
    assert isinstance(enc, PythonChatEncoder)
    # keywords the encoder does not take are not passed (a Python encoder would raise)
    prompt = enc.render([{"role": "user", "content": "hi"}], response_format={"type": "text"},
                        tool_choice="auto")
    assert prompt.endswith("<think>")
    probe = render_probe_prompt(enc)
    assert "TOOLS" in probe and json.dumps("get_weather") in probe
    assert resolve_tool_format("auto", probe).name == "dsml"
    switch = resolve_thinking_switch(enc)
    assert (switch.kwarg, switch.off) == ("thinking_mode", "chat")
