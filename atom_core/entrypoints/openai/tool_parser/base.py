"""The contract a tool-call wire format implements; plugins subclass ToolFormat.

A format only describes its syntax. Reading a stream (what to hold back, when a region
opens and closes, when a tool's name may go out) is done once, by the core, for every
format; a format never writes a reader of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """One call read from a region. ``arguments`` is None while they are still arriving."""

    name: str
    arguments: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ToolFormat:
    """A tool-call wire format.

    START_MARKERS    strings that may begin a region; the stream is never released past a
                     possible prefix of one.
    CALL_SELF_CLOSERS  strings that end one call (``</function>``); a region closes on them.
    REGION_END_MARKERS strings that end a region holding several calls; when set they
                     replace CALL_SELF_CLOSERS as the region's end.
    TEMPLATE_SIGNATURE substrings that, all present in a chat template rendered with a
                     tools payload, identify this format (``--tool-call-parser auto``).
    """

    name: ClassVar[str] = ""
    START_MARKERS: ClassVar[tuple[str, ...]] = ()
    CALL_SELF_CLOSERS: ClassVar[tuple[str, ...]] = ()
    REGION_END_MARKERS: ClassVar[tuple[str, ...]] = ()
    TEMPLATE_SIGNATURE: ClassVar[tuple[str, ...]] = ()

    def opens_region(self, marker: str) -> bool:
        """Whether ``marker`` (one of START_MARKERS) hands the text to this format.

        Formats whose markers include channel framing answer False for those.
        """
        return True

    def parse_region(self, text: str, at_end: bool) -> list[ToolCall] | None:
        """The calls in ``text``, which starts at a start marker.

        ``at_end`` is True when the region has closed or the stream has ended, so a
        truncated call counts; False means a prefix is "not yet". Returns None when the
        text is not (or not yet) a call; the core then releases it verbatim at the end.
        """
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text a model would write to call ``name`` (for tests and corpora)."""
        raise NotImplementedError
