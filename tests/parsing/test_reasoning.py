"""ReasoningChannel: one splitter, two accessors, byte-exact at every chunk size."""

from __future__ import annotations

import pytest

from atom_core.parsing.events import ContentDelta, ReasoningDelta
from atom_core.parsing.reasoning import ReasoningChannel
from atom_core.parsing.reasoning_dialects import ReasoningDialect


class Think(ReasoningDialect):
    name = "think"
    START_MARKERS = ("<think>",)
    END_MARKERS = ("</think>",)
    TEMPLATE_SIGNATURE = ("<think>", "</think>")


def streamed(channel: ReasoningChannel, text: str, size: int) -> tuple[str, str]:
    sp = channel.splitter()
    events = []
    for i in range(0, len(text), size):
        events += sp.feed(text[i : i + size])
    events += sp.finish()
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "".join(e.text for e in events if isinstance(e, ContentDelta)),
    )


CASES = [
    ("<think>\nplan\n</think>\n\nThe answer.", False, ("\nplan\n", "\n\nThe answer.")),
    ("plan</think>\n\nThe answer.", True, ("plan", "\n\nThe answer.")),
    ("no tags, a < b", False, ("", "no tags, a < b")),
    ("Answer.<think>more</think>Again.", False, ("more", "Answer.Again.")),
    ("stray </think> stays", False, ("", "stray </think> stays")),
    ("cut off while <think>thinking", False, ("thinking", "cut off while ")),
    ("```py\nx = 1\n```\n", False, ("", "```py\nx = 1\n```\n")),
]


@pytest.mark.parametrize("text,inside,expected", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 64])
def test_stream_and_whole_agree_byte_for_byte(text, inside, expected, size):
    channel = ReasoningChannel(Think(), starts_inside=inside)
    assert channel.split(text) == expected
    assert streamed(channel, text, size) == expected


def test_reasoning_streams_as_it_arrives():
    sp = ReasoningChannel(Think(), starts_inside=True).splitter()
    assert sp.feed("step one, ") == [ReasoningDelta("step one, ")]
    assert sp.feed("step two </th") == [ReasoningDelta("step two ")]
    assert sp.feed("ink>Answer") == [ContentDelta("Answer")]


def test_whether_output_begins_inside_is_read_from_the_prompt():
    d = Think()
    assert ReasoningChannel.for_prompt(d, "<｜Assistant｜><think>\n").starts_inside
    assert not ReasoningChannel.for_prompt(d, "assistant\n<think>\n\n</think>\n\n").starts_inside
    assert not ReasoningChannel.for_prompt(d, "<|im_start|>assistant\n").starts_inside
    # a user quoting the tag does not open the channel
    assert not ReasoningChannel.for_prompt(d, "user: what is <think>?\nassistant:").starts_inside


def test_no_dialect_is_plain_content():
    channel = ReasoningChannel(None, starts_inside=True)
    assert channel.split("<think>x</think>y") == ("", "<think>x</think>y")
