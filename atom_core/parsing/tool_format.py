"""The contract a tool-call wire format implements; plugins subclass ToolFormat.

A format only describes its syntax. Reading a stream (what to hold back, when a region
opens and closes, when a tool's name may go out, what happens to text after a call, the
rule that a start marker is not a promise) is done once, by the core's stream engine
(``tool_stream.py``), for every format; a format never writes a reader of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from atom_core.errors import UnsupportedError


@dataclass
class ToolCall:
    """One call read from a region. ``arguments`` is None while they are still arriving.

    ``id`` is the call id when the wire format carries one (Kimi's ``functions.f:0``);
    otherwise the engine makes one.
    """

    name: str
    arguments: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    id: str | None = None


class RegionParse(list):
    """What ``parse_region`` read: the calls (this object is the list of them) and the two
    offsets that bracket the format's own markup in the region's text.

    Bytes before ``start`` and from ``end`` on are the answer's, and the engine hands them
    back as content; ``end=None`` means the markup runs to the end of the text. An empty
    RegionParse is markup that holds no call (dropped); None from ``parse_region`` means
    "not a call", and the region is released verbatim.
    """

    def __init__(
        self, calls: Iterable[ToolCall] = (), start: int = 0, end: int | None = None
    ) -> None:
        super().__init__(calls)
        self.start = start
        self.end = end

    def __repr__(self) -> str:
        return f"RegionParse({list.__repr__(self)}, start={self.start}, end={self.end})"


class ToolFormat:
    """A tool-call wire format.

    START_MARKERS      strings that may begin a region, or framing; the stream is never
                       released past a possible prefix of one.
    opens_region(m)    which START_MARKERS hand the stream to the format; the others are
                       framing the engine drops (Kimi-K3's ``<|open|>response<|sep|>``).
    CALL_SELF_CLOSERS  strings that end one call (``</function>``); a region closes on them.
                       List each among the terminators of an argument value in your
                       grammar, so the literal can never hide inside a value.
    REGION_END_MARKERS strings that end a region holding several calls (Kimi-K2's
                       section); when set they replace CALL_SELF_CLOSERS as the region end.
    WRAPPER_CLOSERS    closers of an outer wrapper (``</tool_call>`` around Qwen's
                       ``<function=...>``). Recognised only right after a call, where they
                       (and the whitespace before them) are dropped; elsewhere ordinary text.
    TEMPLATE_SIGNATURE substrings that, all present in the chat template rendered with a
                       tools payload and a tool-call turn, identify this format
                       (``--tool-call-parser auto``).
    DETECT_PRIORITY    formats whose signature contains another's (Qwen-Coder's
                       ``<tool_call>`` + ``<function=`` vs Hermes' ``<tool_call>``) set a
                       higher number; detection tries higher first.

    A region that never meets a closer is held to the end of the stream and then parsed
    with ``at_end=True``; a format with no closers at all (Mistral's) relies on that.
    """

    name: ClassVar[str] = ""
    START_MARKERS: ClassVar[tuple[str, ...]] = ()
    CALL_SELF_CLOSERS: ClassVar[tuple[str, ...]] = ()
    REGION_END_MARKERS: ClassVar[tuple[str, ...]] = ()
    WRAPPER_CLOSERS: ClassVar[tuple[str, ...]] = ()
    TEMPLATE_SIGNATURE: ClassVar[tuple[str, ...]] = ()
    DETECT_PRIORITY: ClassVar[int] = 0

    def opens_region(self, marker: str) -> bool:
        """Whether ``marker`` (one of START_MARKERS) hands the text to this format.

        Formats whose markers include channel framing answer False for those.
        """
        return True

    def parse_region(self, text: str, at_end: bool) -> RegionParse | list[ToolCall] | None:
        """The calls in ``text``, which starts at a region-opening marker.

        ``at_end`` is True when the region has closed or the stream has ended, so a
        truncated call counts (its half-written value becomes a string); False means a
        prefix is "not yet". With ``at_end=False`` the engine asks over the region's first
        bytes (``Region.HEAD``) to learn a tool's name early: return the call with
        ``arguments=None`` once its name is complete, or None. Return None when the text
        is not (or not yet) a call; the engine then releases it verbatim. A plain list is
        read as a RegionParse whose markup is the whole text.
        """
        raise NotImplementedError

    def matches_template(self, rendered: str) -> bool:
        """Whether a chat template rendered with tools (``render_probe_prompt``) shows
        this format. The default: every TEMPLATE_SIGNATURE substring is present."""
        return bool(self.TEMPLATE_SIGNATURE) and all(s in rendered for s in self.TEMPLATE_SIGNATURE)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text a model would write to call ``name`` (for tests and corpora)."""
        raise NotImplementedError

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        """Lark rules (llguidance's dialect) defining ``calls``: one call of one of
        ``functions`` (name -> parameters' JSON schema, None for any object), or one or
        more when ``parallel``, written as this format writes them, so that the format's
        own reader reads each back with arguments valid under their schema. ``special``:
        the tokenizer's special tokens; a marker among them is matched as that token
        (``call_grammar.literal``). What follows ``calls`` is the end of the text.

        tool_choice "required" and named functions are served through this; a format
        that does not implement it answers those requests with a 400 naming itself."""
        raise UnsupportedError(f"the {self.name or type(self).__name__} tool-call format "
                               "cannot force a call")

    def call_grammar(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                     special: Collection[str] = frozenset()) -> str:
        """A whole grammar: ``call_rules`` from the reply's first byte to its end."""
        return "start: calls\n" + self.call_rules(functions, parallel, special)
