"""The stream engine's rules, on a toy format (tests/parsing/toy_format.py)."""

from __future__ import annotations

import itertools
import json

import pytest

from atom_core.errors import InvalidRequestError
from atom_core.parsing.events import (
    ContentDelta,
    ToolCallArguments,
    ToolCallStart,
)
from atom_core.parsing.tool_policy import ToolPolicy
from atom_core.parsing.tool_stream import Region, ToolCallStream
from tests.parsing.toy_format import ToyFormat

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


def run(text: str, size: int | None = None, tools=TOOLS, tool_choice=None, parallel=True):
    ids = (f"id{i}" for i in itertools.count())
    policy = ToolPolicy.from_request(tools, tool_choice, parallel)
    st = ToolCallStream(ToyFormat(), policy, make_id=lambda: next(ids))
    size = size or max(len(text), 1)
    per_feed = [st.feed(text[i : i + size]) for i in range(0, len(text), size)]
    per_feed.append(st.finish())
    events = [e for evs in per_feed for e in evs]
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [(c.name, json.loads(c.arguments)) for c in st.calls]
    return content, calls, per_feed, st


SIZES = [1, 2, 3, 5, 8, 64, None]


@pytest.mark.parametrize("size", SIZES)
def test_the_answer_after_a_call_streams(size):
    text = 'Checking.\n<call>get_weather {"city": "Paris"}</call>\nIt is sunny.'
    content, calls, per_feed, _ = run(text, size)
    assert content == "Checking.\n\nIt is sunny."
    assert calls == [("get_weather", {"city": "Paris"})]
    if size == 1:  # "It is sunny." arrives before the end of the stream
        assert "".join(e.text for e in per_feed[-1] if isinstance(e, ContentDelta)) == ""


@pytest.mark.parametrize("size", SIZES)
def test_a_start_marker_is_not_a_promise(size):
    text = "Write <call> then a name. Nothing else."
    content, calls, _, _ = run(text, size)
    assert (content, calls) == (text, [])


@pytest.mark.parametrize("size", SIZES)
def test_a_quoted_opener_before_a_real_call_loses_neither(size):
    text = 'Use <call> like this: <call>search {"q": "x"}</call> done'
    content, calls, _, _ = run(text, size)
    assert content == "Use <call> like this:  done"
    assert calls == [("search", {"q": "x"})]


@pytest.mark.parametrize("size", SIZES)
def test_framing_is_dropped_and_wrapper_closers_only_after_a_call(size):
    text = '[[frame]]Hi </calls> there.<call>search {}</call>\n</calls>\n[[frame]]'
    content, calls, _, _ = run(text, size)
    assert content == "Hi </calls> there."
    assert calls == [("search", {})]


@pytest.mark.parametrize("size", SIZES)
def test_two_calls_get_consecutive_indices(size):
    text = '<call>search {"q": 1}</call>\n<call>get_weather {"city": "Oslo"}</call>'
    content, calls, per_feed, st = run(text, size)
    assert content == ""
    assert [c.index for c in st.calls] == [0, 1]
    starts = [e for evs in per_feed for e in evs if isinstance(e, ToolCallStart)]
    assert [(s.index, s.name) for s in starts] == [(0, "search"), (1, "get_weather")]


@pytest.mark.parametrize("size", SIZES)
def test_without_parallel_calls_only_the_first_permitted_call_goes_out(size):
    # parallel_tool_calls false: the first call that may be dispatched is, the rest are
    # dropped like forbidden ones (markup and all), at every chunk size; a forbidden call
    # before it does not use up the one.
    text = ('Ok.<call>get_weather {"city": "Oslo"}</call><call>search {"q": 1}</call> then'
            '<call>get_weather {"city": "Rome"}</call> done')
    choice = {"type": "function", "function": {"name": "search"}}
    cases = ((None, [("get_weather", {"city": "Oslo"})]), (choice, [("search", {"q": 1})]))
    for tool_choice, want in cases:
        content, calls, per_feed, st = run(text, size, tool_choice=tool_choice, parallel=False)
        assert (content, calls, st.suppressed) == ("Ok. then done", want, 2)
        starts = [e for evs in per_feed for e in evs if isinstance(e, ToolCallStart)]
        assert [(e.index, e.name) for e in starts] == [(0, want[0][0])]
        assert [e.index for evs in per_feed for e in evs if isinstance(e, ToolCallArguments)] == [0]


def test_the_name_goes_out_before_the_arguments_for_a_declared_tool():
    text = '<call>get_weather {"city": "' + "x" * 800 + '"}</call>'
    _, _, per_feed, _ = run(text, 8)
    def first(kind: type) -> int:
        return next(i for i, evs in enumerate(per_feed) if any(isinstance(e, kind) for e in evs))

    start, args = first(ToolCallStart), first(ToolCallArguments)
    assert start < 5 < args


def test_an_undeclared_name_waits_for_the_whole_call():
    text = '<call>mystery {"a": "' + "x" * 300 + '"}</call>'
    _, calls, per_feed, _ = run(text, 8, tools=None)
    first = [i for i, evs in enumerate(per_feed) if evs]
    assert calls == [("mystery", {"a": "x" * 300})]
    assert isinstance(per_feed[first[0]][0], ToolCallStart) and first[0] == len(text) // 8


def test_the_early_read_is_bounded_to_the_head():
    calls = []

    class Counting(ToyFormat):
        def parse_region(self, text, at_end):
            calls.append(len(text))
            return None if not at_end else super().parse_region(text, at_end)

    st = ToolCallStream(Counting(), ToolPolicy.from_request(TOOLS))
    for ch in "<call>" + "y" * 5000:
        st.feed(ch)
    assert max(calls) <= Region.HEAD and len(calls) <= Region.HEAD


@pytest.mark.parametrize("size", SIZES)
def test_tool_choice_none_drops_the_call_not_the_answer(size):
    text = 'Sure.<call>get_weather {"city": "Paris"}</call> Anything else?'
    content, calls, per_feed, st = run(text, size, tool_choice="none")
    assert (content, calls, st.suppressed) == ("Sure. Anything else?", [], 1)
    call_events = (ToolCallStart, ToolCallArguments)
    assert not any(isinstance(e, call_events) for evs in per_feed for e in evs)


def test_a_named_tool_choice_dispatches_only_that_tool():
    text = '<call>search {}</call><call>get_weather {"city": "Rome"}</call>'
    choice = {"type": "function", "function": {"name": "get_weather"}}
    _, calls, _, st = run(text, 3, tool_choice=choice)
    assert calls == [("get_weather", {"city": "Rome"})] and st.calls[0].index == 0


def test_required_dispatches_declared_tools_only():
    _, calls, _, _ = run('<call>rogue {}</call><call>search {}</call>', tool_choice="required")
    assert calls == [("search", {})]


def test_bad_tool_choice_is_a_request_error():
    with pytest.raises(InvalidRequestError):
        ToolPolicy.from_request(TOOLS, "sometimes")
    with pytest.raises(InvalidRequestError):
        ToolPolicy.from_request(TOOLS, {"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("size", SIZES)
def test_a_call_cut_by_max_tokens_yields_valid_json(size):
    content, calls, _, st = run('<call>get_weather {"city": "Par', size)
    assert content == "" and calls == [("get_weather", {"city": "Par"})]


def test_arguments_are_typed_by_the_schema():
    _, calls, _, _ = run('<call>get_weather {"city": "Nice", "days": "3"}</call>')
    assert calls == [("get_weather", {"city": "Nice", "days": 3})]


def test_content_before_any_marker_is_held_at_most_a_marker_prefix():
    st = ToolCallStream(ToyFormat(), ToolPolicy())
    for ch in "if (a < b) { return a <= b; } <cal":
        st.feed(ch)
        assert st.held < st.longest_marker


def test_without_a_format_everything_is_content():
    st = ToolCallStream(None)
    assert st.feed('<call>x {}</call>') == [ContentDelta('<call>x {}</call>')]
    assert st.finish() == []


def test_required_with_no_call_is_reported_not_invented():
    from atom_core.parsing.response import ResponseParser

    parser = ResponseParser(ToyFormat())
    res = parser.read_whole("I will not call anything.", tools=TOOLS, tool_choice="required")
    assert (res.tool_calls, res.finish_reason, res.required_unmet) == ([], "stop", True)
    res = parser.read_whole("<call>search {}</call>", tools=TOOLS, tool_choice="required")
    assert (res.finish_reason, res.required_unmet) == ("tool_calls", False)


def test_a_declared_list_without_the_name_means_no_early_name():
    text = '<call>mystery {"a": "' + "x" * 300 + '"}</call>'
    _, calls, per_feed, _ = run(text, 8)  # TOOLS declares get_weather and search only
    first = next(i for i, evs in enumerate(per_feed) if evs)
    assert calls == [("mystery", {"a": "x" * 300})] and first == len(text) // 8
