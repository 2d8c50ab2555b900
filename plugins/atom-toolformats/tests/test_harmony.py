"""gpt-oss's harmony format: what each header, channel and malformed call yields, the same
whole and streamed at every split."""

from __future__ import annotations

import json

import pytest
from atom_toolformats.harmony import HarmonyDialect, HarmonyFormat

from atom_core.parsing.events import ReasoningDelta, ToolCallArguments, ToolCallStart
from atom_core.parsing.response import ResponseParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
PARSER = ResponseParser(HarmonyFormat(), HarmonyDialect())
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
NEXT = "<|start|>assistant"


def whole(text: str, **request):
    res = PARSER.read_whole(text, tools=TOOLS, **request)
    calls = [(c.name, json.loads(c.arguments)) for c in res.tool_calls]
    return res.reasoning_content, res.content, calls, res.finish_reason


def streamed(text: str, cuts: list[int], finish_reason: str = "stop", **request):
    reader = PARSER.reader(tools=TOOLS, **request)
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        reader.feed(text[a:b])
    reader.finish(finish_reason)
    res = reader.result()
    calls = [(c.name, json.loads(c.arguments)) for c in res.tool_calls]
    return res.reasoning_content, res.content, calls, res.finish_reason


def splits(text: str):
    """Every single cut point, and fixed chunk sizes: a token may end anywhere."""
    for i in range(1, len(text)):
        yield [i]
    for n in (1, 2, 3, 5, 8, 13):
        yield list(range(n, len(text), n))


# reply -> (reasoning, content, calls)
CASES = {
    "reasoning then a call": (
        f'<|channel|>analysis<|message|>Need the weather.<|end|>{NEXT}{CALL}{{"city": "Paris"}}'
        "<|call|>",
        ("Need the weather.", "", [("get_weather", {"city": "Paris"})]),
    ),
    "the stop token dropped": (
        f'<|channel|>analysis<|message|>Look.<|end|>{NEXT}{CALL}{{"city": "Paris"}}',
        ("Look.", "", [("get_weather", {"city": "Paris"})]),
    ),
    "reasoning then the answer": (
        f"<|channel|>analysis<|message|>Easy.<|end|>{NEXT}<|channel|>final<|message|>"
        "It is *sunny*, 21 < 30.<|return|>",
        ("Easy.", "It is *sunny*, 21 < 30.", []),
    ),
    "a preamble is content": (
        f"<|channel|>commentary<|message|>Checking.<|end|>{NEXT}{CALL}{{}}<|call|>",
        ("", "Checking.", [("get_weather", {})]),
    ),
    "the recipient after the role, as the template writes it": (
        f'{NEXT} to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "Oslo"}}'
        "<|call|>",
        ("", "", [("get_weather", {"city": "Oslo"})]),
    ),
    "no content type": (
        '<|channel|>commentary to=functions.get_weather<|message|>{"days": 2}<|call|>',
        ("", "", [("get_weather", {"days": 2})]),
    ),
    "a function call on the analysis channel": (
        '<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{"days": 1}'
        "<|call|>",
        ("", "", [("get_weather", {"days": 1})]),
    ),
    "a call ended by <|end|>, then the answer": (
        f'{CALL}{{"city": "Rome"}}<|end|>{NEXT}<|channel|>final<|message|>Sunny.<|return|>',
        ("", "Sunny.", [("get_weather", {"city": "Rome"})]),
    ),
    # malformed: each yields something defined, never a crash or a lost byte of prose
    "a body that is not JSON: the call with {}, the body as content": (
        f"{CALL}city=Paris<|call|>",
        ("", "city=Paris", [("get_weather", {})]),
    ),
    "text after the object is content": (
        f'{CALL}{{"city": "Rome"}} and more<|call|>',
        ("", " and more", [("get_weather", {"city": "Rome"})]),
    ),
    "JSON that is not an object": (
        f"{CALL}[1, 2]<|call|>",
        ("", "[1, 2]", [("get_weather", {})]),
    ),
    "an object sent as a JSON string": (
        f'{CALL}"{{\\"city\\": \\"Lima\\"}}"<|call|>',
        ("", "", [("get_weather", {"city": "Lima"})]),
    ),
    "an empty body": (
        f"{CALL}  <|call|>",
        ("", "", [("get_weather", {})]),
    ),
    "a recipient outside functions is text": (
        "<|channel|>analysis to=python code<|message|>print(1)<|call|>",
        ("", "<|channel|>analysis to=python code<|message|>print(1)", []),
    ),
    "a header that never reaches <|message|> is text": (
        "<|channel|>commentary to=functions.get_weather is how you call it.<|end|>",
        ("", "<|channel|>commentary to=functions.get_weather is how you call it.", []),
    ),
    "a quoted opener before a real call": (
        f"{NEXT}<|channel|>final<|message|>Write <|channel|>commentary to= first.<|end|>"
        f'{NEXT}{CALL}{{"city": "Nice"}}<|call|>',
        ("", "Write <|channel|>commentary to= first.", [("get_weather", {"city": "Nice"})]),
    ),
    "an unclosed analysis channel is all reasoning": (
        "<|channel|>analysis<|message|>Still thinking about <|channel|>final",
        ("Still thinking about <|channel|>final", "", []),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_and_streamed_at_every_split_agree_with_the_definition(case):
    text, (reasoning, content, calls) = CASES[case]
    expected = (reasoning, content, calls, "tool_calls" if calls else "stop")
    assert whole(text) == expected
    for cuts in splits(text):
        assert streamed(text, cuts) == expected, cuts


@pytest.mark.parametrize("keep", [
    CALL + '{"city": "Par',  # in the body: the value is closed
    CALL,  # the header complete, no body yet
])
def test_a_call_cut_by_max_tokens(keep):
    res = whole(keep, finish_reason="length")
    assert res[2] == [("get_weather", {"city": "Par"} if "Par" in keep else {})]
    for cuts in splits(keep):
        assert streamed(keep, cuts, finish_reason="length") == res


@pytest.mark.parametrize("cut", ["<|channel|>commentary to=functions.get_wea", CALL[:-4]])
def test_a_call_cut_before_its_header_ends_is_text(cut):
    assert whole(cut, finish_reason="length") == ("", cut, [], "length")


def test_reasoning_and_content_stream_and_the_name_precedes_the_arguments():
    text = (
        "<|channel|>analysis<|message|>" + "think " * 20 + f"<|end|>{NEXT}{CALL}"
        + json.dumps({"city": "x" * 400}) + "<|call|>"
    )
    reader = PARSER.reader(tools=TOOLS)
    seen = []
    for i in range(0, len(text), 4):
        for ev in reader.feed(text[i : i + 4]):
            seen.append((i, type(ev)))
    seen += [(len(text), type(ev)) for ev in reader.finish()]
    reasoning_at = [i for i, t in seen if t is ReasoningDelta]
    assert len(reasoning_at) > 10  # one delta per chunk, not one at the end
    start = next(i for i, t in seen if t is ToolCallStart)
    args = next(i for i, t in seen if t is ToolCallArguments)
    assert start < text.index("x" * 10) < args


def test_a_forbidden_call_is_dropped_and_the_rest_kept():
    text = (
        f"<|channel|>analysis<|message|>Hm.<|end|>{NEXT}<|channel|>commentary<|message|>"
        f'On it.<|end|>{NEXT}{CALL}{{"city": "Paris"}}<|call|>'
    )
    for cuts in [[], *splits(text)]:
        assert streamed(text, cuts, tool_choice="none") == ("Hm.", "On it.", [], "stop")


def test_an_undeclared_tool_is_named_only_with_its_arguments():
    text = CALL.replace("get_weather", "get_time") + '{"tz": "' + "x" * 300 + '"}<|call|>'
    reader = PARSER.reader(tools=TOOLS)
    kinds = [[type(e) for e in reader.feed(text[i : i + 8])] for i in range(0, len(text), 8)]
    kinds.append([type(e) for e in reader.finish()])
    [when] = [i for i, k in enumerate(kinds) if ToolCallStart in k]
    assert ToolCallArguments in kinds[when]
    assert reader.result().tool_calls[0].name == "get_time"


def test_without_the_dialect_the_analysis_channel_is_content_without_its_markup():
    text = f"<|channel|>analysis<|message|>Hm.<|end|>{NEXT}<|channel|>final<|message|>Hi."
    res = ResponseParser(HarmonyFormat()).read_whole(text)
    assert (res.reasoning_content, res.content) == ("", "Hm.Hi.")


def test_plain_text_is_held_at_most_a_marker_prefix():
    reader = ResponseParser(HarmonyFormat(), HarmonyDialect()).reader()
    out = "".join(e.text for e in reader.feed("No markup here, x<y and <|sta"))
    assert out == "No markup here, x<y and "


def test_render_call_is_what_the_parse_reads():
    fmt = HarmonyFormat()
    wire = fmt.render_call("get_weather", {"city": "Paris"})
    assert wire == CALL + '{"city": "Paris"}<|call|>'
    assert [(c.name, c.arguments) for c in fmt.parse_region(wire, at_end=True)] == [
        ("get_weather", {"city": "Paris"})]
