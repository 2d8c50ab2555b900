"""Details particular to one format each."""

from __future__ import annotations

import json

from atom_toolformats.deepseek_v31 import DeepSeekV31Format
from atom_toolformats.dsml import DsmlFormat
from atom_toolformats.glm import GlmFormat
from atom_toolformats.kimi import KimiK2Format
from atom_toolformats.kimi_k3 import KimiK3Dialect, KimiK3Format
from atom_toolformats.minimax import MiniMaxFormat
from atom_toolformats.qwen import QwenCoderFormat

from atom_core.parsing.response import ResponseParser

PROPERTIES = {"n": {"type": "integer"}, "s": {"type": "string"}, "b": {"type": "boolean"}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": PROPERTIES}}}]


def calls(res):
    return [(c.name, json.loads(c.arguments)) for c in res.tool_calls]


def test_qwen_values_are_typed_by_the_schema_and_the_wrapper_closer_is_dropped():
    text = (
        "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n"
        "<parameter=s>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    res = ResponseParser(QwenCoderFormat()).read_whole(text, tools=TOOLS)
    assert calls(res) == [("f", {"n": 3, "s": "3"})] and res.content == ""


def test_qwen_a_function_closer_ends_an_unfinished_parameter():
    text = "<tool_call>\n<function=f>\n<parameter=s>\nabc</function>\nafter"
    res = ResponseParser(QwenCoderFormat()).read_whole(text, tools=TOOLS)
    assert calls(res) == [("f", {"s": "abc"})] and res.content == "\nafter"


def test_glm_without_newlines():
    text = "<tool_call>f<arg_key>b</arg_key><arg_value>true</arg_value></tool_call>"
    assert calls(ResponseParser(GlmFormat()).read_whole(text, tools=TOOLS)) == [("f", {"b": True})]


def test_minimax_two_invokes_in_one_wrapper():
    text = (
        '<minimax:tool_call>\n<invoke name="f">\n<parameter name="n">1</parameter>\n</invoke>\n'
        '<invoke name="f">\n<parameter name="n">2</parameter>\n</invoke>\n</minimax:tool_call>'
    )
    res = ResponseParser(MiniMaxFormat()).read_whole(text, tools=TOOLS)
    assert calls(res) == [("f", {"n": 1}), ("f", {"n": 2})] and res.content == ""


def test_dsml_string_false_is_json_and_a_bare_invoke_is_a_call():
    text = (
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="n" string="false">[1, 2]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="s" string="true">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>'
    )
    expected = [("f", {"n": [1, 2], "s": "[1, 2]"})]
    assert calls(ResponseParser(DsmlFormat()).read_whole(text)) == expected


def test_dsml_direct_json_body_and_self_closing_invoke():
    fmt = DsmlFormat()
    text = (
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">{"n": 5, "s": "x"}</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>"
    )
    assert calls(ResponseParser(fmt).read_whole(text)) == [("f", {"n": 5, "s": "x"})]
    text = (
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f"/>\n'
        '<｜DSML｜invoke name="g">{}</｜DSML｜invoke>\n</｜DSML｜function_calls>'
    )
    assert calls(ResponseParser(fmt).read_whole(text)) == [("f", {}), ("g", {})]


def test_deepseek_v31_two_calls():
    text = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"n": 1}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>f<｜tool▁sep｜>{"n": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    res = ResponseParser(DeepSeekV31Format()).read_whole(text)
    assert calls(res) == [("f", {"n": 1}), ("f", {"n": 2})] and res.content == ""


def test_kimi_k2_section_of_two_keeps_the_model_ids():
    text = (
        "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"n": 1}<|tool_call_end|><|tool_call_begin|>functions.f:1'
        '<|tool_call_argument_begin|>{"n": 2}'
        "<|tool_call_end|><|tool_calls_section_end|>"
    )
    res = ResponseParser(KimiK2Format()).read_whole(text)
    assert calls(res) == [("f", {"n": 1}), ("f", {"n": 2})]
    assert [c.id for c in res.tool_calls] == ["functions.f:0", "functions.f:1"]
    assert res.content == "Let me look."


def test_kimi_k2_a_cut_entry_is_closed_into_valid_json():
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"s": "Par'
    )
    res = ResponseParser(KimiK2Format()).read_whole(text, finish_reason="length")
    assert calls(res) == [("f", {"s": "Par"})]


def test_kimi_k3_framing_never_leaks_even_under_tool_choice_none():
    text = "<|open|>response<|sep|>Hello there.<|close|>response<|sep|><|end_of_msg|>"
    for choice in ("auto", "none"):
        parser = ResponseParser(KimiK3Format(), KimiK3Dialect())
        res = parser.read_whole(text, tools=TOOLS, tool_choice=choice)
        assert (res.content, res.reasoning_content) == ("Hello there.", "")


def test_kimi_k3_reasoning_then_a_call_then_an_answer():
    text = (
        "<|open|>think<|sep|>Need weather.<|close|>think<|sep|><|open|>response<|sep|>Checking."
        "<|close|>response<|sep|><|open|>call<|sep|>f<|sep|>"
        '{"n": 1}<|close|>call<|sep|><|end_of_msg|>'
    )
    res = ResponseParser(KimiK3Format(), KimiK3Dialect()).read_whole(text, tools=TOOLS)
    expected = ("Need weather.", "Checking.", [("f", {"n": 1})])
    assert (res.reasoning_content, res.content, calls(res)) == expected


def test_kimi_k3_a_quoted_call_opener_is_released_verbatim():
    answer = "K3 opens a call with <|open|>call<|sep|> and a name."
    text = f"<|open|>response<|sep|>{answer}<|close|>response<|sep|>"
    res = ResponseParser(KimiK3Format()).read_whole(text, tools=TOOLS)
    assert res.content == answer and not res.tool_calls
