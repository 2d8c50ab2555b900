"""Each format reads what its template writes, names a call early where it can, and
gives back a cut call as valid arguments."""

from __future__ import annotations

import json

import pytest
from atom_toolformats.hooks import FORMATS

from atom_core.parsing.response import ResponseParser

ARGS = {"city": "Paris", "days": 3, "units": {"temp": "C"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"},
    },
}}}]


@pytest.fixture(params=[f.name for f in FORMATS])
def fmt(request):
    return next(f for f in FORMATS if f.name == request.param)()


def test_parses_what_it_renders(fmt):
    text = fmt.render_call("get_weather", ARGS)
    parser = ResponseParser(fmt)
    res = parser.read_whole("Sure.\n" + text + "\nDone.", tools=TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in res.tool_calls] == [("get_weather", ARGS)]
    assert res.content == "Sure.\n\nDone."


def test_a_quoted_opener_is_not_a_call(fmt):
    for marker in [m for m in fmt.START_MARKERS if fmt.opens_region(m)]:
        text = f"The tag {marker} starts a call; write it and nothing else."
        res = ResponseParser(fmt).read_whole(text, tools=TOOLS)
        assert (res.content, res.tool_calls) == (text, [])


def test_a_cut_call_yields_valid_json(fmt):
    text = fmt.render_call("get_weather", {"city": "Paris, the capital of France"})
    cut = text[: text.index("capital") + 3]
    res = ResponseParser(fmt).read_whole(cut, finish_reason="length", tools=TOOLS)
    [call] = res.tool_calls
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and args["city"].startswith("Paris, the cap")


def test_two_calls_in_a_row(fmt):
    first, second = (fmt.render_call("get_weather", {"city": c}) for c in "AB")
    text = first + "\n" + second
    res = ResponseParser(fmt).read_whole(text, tools=TOOLS)
    assert [json.loads(c.arguments)["city"] for c in res.tool_calls] == ["A", "B"]
    assert res.content == ""
