"""What a ResponseReader hands a server: one event per thing the client should learn.

A server maps them to its wire: on /v1/chat/completions ContentDelta -> ``delta.content``,
ReasoningDelta -> ``delta.reasoning_content``, ToolCallStart -> a ``tool_calls`` delta with
index, id, type and name, ToolCallArguments -> one with the arguments. On /v1/messages a
tool_use block opens on ToolCallArguments (its ``input`` must be complete), not on
ToolCallStart.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    """A call's name is legible and the request declared the tool (or the call closed)."""

    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArguments:
    """A call is complete: ``arguments`` is the whole JSON object, as text."""

    index: int
    arguments: str


Event = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArguments


@dataclass(slots=True)
class DispatchedCall:
    """A tool call as the response carries it."""

    index: int
    id: str
    name: str
    arguments: str


def merge_deltas(events: list[Event]) -> list[Event]:
    """Adjacent text deltas of one kind as one (fewer, larger SSE frames); empty ones go."""
    if len(events) < 2:  # the common case, one delta per engine step
        return [e for e in events if not isinstance(e, (ContentDelta, ReasoningDelta)) or e.text]
    out: list[Event] = []
    run: list[str] = []
    kind: type | None = None

    def close_run() -> None:
        text = "".join(run)
        if text:
            out.append(kind(text))
        run.clear()

    for ev in events:
        if isinstance(ev, (ContentDelta, ReasoningDelta)):
            if type(ev) is not kind:
                close_run()
                kind = type(ev)
            run.append(ev.text)
        else:
            close_run()
            kind = None
            out.append(ev)
    close_run()
    return out
