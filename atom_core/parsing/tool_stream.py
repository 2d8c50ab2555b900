"""ToolCallStream: the one tool-call reader, used by both delivery modes.

stream=false is this engine fed the whole text at once and then finished; there is no
second implementation. It owns everything a format does not declare:

- Reading ahead. Before any start marker a byte is held only while it could begin one
  (MarkerScanner, bounded by the longest marker). Framing markers (``opens_region`` False)
  are dropped where they stand.
- Regions. A region-opening marker hands the text to the format until a closer
  (REGION_END_MARKERS, else CALL_SELF_CLOSERS) or the end of the stream, and the region
  is then parsed once with ``at_end=True``.
- A start marker is not a promise. A region that parses to no call gives back its opener
  verbatim and the rest is read again as ordinary text (where it may hold a real call);
  nothing is deleted.
- The answer after a call streams as it arrives. Only whitespace that joins a call to
  more markup (a wrapper closer, the next call, framing) is dropped with it; whitespace
  before ordinary text or the end of the stream is the answer's.
- The tool's name goes out early: while a region's first ``Region.HEAD`` characters
  arrive, the format's own ``parse_region(head, at_end=False)`` is asked for a call, and
  a name the request declared is announced. The head bounds the cost; past it the name
  comes with the arguments.
- Call indices, ids, schema coercion of argument values, and the tool_choice policy.

Time is linear in the stream: each byte is searched for start markers once and for
closers once, and a region's text is joined once, when it closes.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from atom_core.parsing.coerce import coerce_arguments
from atom_core.parsing.events import (
    ContentDelta,
    DispatchedCall,
    Event,
    ToolCallArguments,
    ToolCallStart,
)
from atom_core.parsing.marker_scanner import MarkerHit, MarkerScanner
from atom_core.parsing.tool_format import RegionParse, ToolCall, ToolFormat
from atom_core.parsing.tool_policy import ToolPolicy

logger = logging.getLogger(__name__)

_TEXT, _REGION, _AFTER = "text", "region", "after"
_WS = " \t\r\n"
# Whitespace after a call is held (to see whether markup follows) for at most this many
# characters; a longer run is the answer's and goes out as content.
AFTER_CALL_WS_LIMIT = 16


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Region:
    """An open region: the text from a region-opening marker, until it closes.

    Its text is the stored ``parts`` followed by the current string from ``start``;
    ``base`` is the length of the stored parts when this string began.
    """

    HEAD: ClassVar[int] = 256  # how far parse_region is asked for an early name

    opener: str
    start: int
    search: int
    parts: list[str] = field(default_factory=list)
    base: int = 0
    head: str = ""
    asked: int = 0
    announced: DispatchedCall | None = None


class ToolCallStream:
    """Feed text deltas, get content and tool-call events; ``finish()`` at end of stream."""

    def __init__(
        self,
        fmt: ToolFormat | None,
        policy: ToolPolicy | None = None,
        make_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._fmt = fmt
        self._policy = policy if policy is not None else ToolPolicy()
        self._make_id = make_id
        markers = fmt.START_MARKERS if fmt is not None else ()
        self._starts = MarkerScanner(markers)
        self._openers = frozenset(m for m in markers if fmt is not None and fmt.opens_region(m))
        closers = (fmt.REGION_END_MARKERS or fmt.CALL_SELF_CLOSERS) if fmt is not None else ()
        self._closers = MarkerScanner(closers)
        wrappers = fmt.WRAPPER_CLOSERS if fmt is not None else ()
        self._after = MarkerScanner((*markers, *wrappers))
        self._steps = {_TEXT: self._step_text, _REGION: self._step_region, _AFTER: self._step_after}
        self._mode = _TEXT
        self._held = ""
        self._region: Region | None = None
        self._s = ""
        self._pos = 0
        self._known_closer: tuple[int, MarkerHit | None] | None = None
        self._events: list[Event] = []
        self._next_index = 0
        self.calls: list[DispatchedCall] = []
        self.suppressed = 0  # calls parsed and not dispatched (tool_choice)

    @property
    def longest_marker(self) -> int:
        return self._starts.longest

    @property
    def in_region(self) -> bool:
        return self._region is not None

    @property
    def held(self) -> int:
        """Characters fed and not yet released as content or consumed as markup."""
        r = self._region
        return len(self._held) + (r.base if r is not None else 0)

    def feed(self, text: str) -> list[Event]:
        self._run(text, at_end=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run("", at_end=True)
        return self._take()

    # -- the loop -----------------------------------------------------------------------

    def _take(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def _run(self, delta: str, at_end: bool) -> None:
        self._s = self._held + delta
        self._held = ""
        self._pos = 0
        self._known_closer = None
        if self._region is not None:
            self._region.start = self._region.search = 0
        steps = self._steps
        while steps[self._mode](at_end):
            pass
        self._s = ""

    def _content(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))

    def _step_text(self, at_end: bool) -> bool:
        s, pos = self._s, self._pos
        hit = self._starts.find(s, pos, at_end)
        if hit is None:
            end = len(s) if at_end else self._starts.safe_end(s, pos)
            self._content(s[pos:end])
            self._held, self._pos = s[end:], len(s)
            return False
        self._content(s[pos : hit.start])
        if hit.marker in self._openers:
            self._open(hit)
        else:
            self._pos = hit.end  # framing: the format's, not the answer's
        return True

    def _step_after(self, at_end: bool) -> bool:
        s, pos = self._s, self._pos
        q = pos
        while q < len(s) and s[q] in _WS and q - pos <= AFTER_CALL_WS_LIMIT:
            q += 1
        if q - pos > AFTER_CALL_WS_LIMIT:
            self._mode = _TEXT
            return True
        hit = self._after.match(s, q, at_end)
        if hit is True:  # whitespace, or a marker's beginning: wait for the rest
            self._held, self._pos = s[pos:], len(s)
            return False
        if hit is False:  # ordinary text (or the end): the whitespace is the answer's
            self._mode = _TEXT
            return True
        if hit.marker in self._openers:
            self._open(hit)
        else:
            self._pos = hit.end  # a wrapper closer or framing, with the whitespace before it
        return True

    # -- regions ------------------------------------------------------------------------

    def _open(self, hit: MarkerHit) -> None:
        self._region = Region(hit.marker, start=hit.start, search=hit.end)
        self._mode = _REGION
        self._pos = hit.start

    def _step_region(self, at_end: bool) -> bool:
        r, s = self._region, self._s
        assert r is not None
        known = self._known_closer
        if (known is not None and r.search >= known[0]
                and (known[1] is None or r.search <= known[1].start)):
            # A region that failed around this one already searched these bytes.
            self._close(known[1].end if known[1] is not None else len(s), known[1])
            return True
        hit = self._closers.find(s, r.search, at_end)
        if hit is not None or at_end:
            self._close(hit.end if hit is not None else len(s), hit)
            return True
        keep = self._closers.safe_end(s, r.search)
        self._grow_head(s)
        r.parts.append(s[r.start : keep])
        r.base += keep - r.start
        self._held, self._pos = s[keep:], len(s)
        self._ask()
        return False

    def _grow_head(self, s: str) -> None:
        r = self._region
        have = len(r.head)
        upto = min(Region.HEAD, r.base + len(s) - r.start)
        if upto > have:
            r.head += s[r.start + have - r.base : r.start + upto - r.base]

    def _ask(self) -> None:
        """The early name: parse_region over the head, at_end=False."""
        r = self._region
        if r.announced is not None or r.asked >= len(r.head):
            return
        r.asked = len(r.head)
        res = self._parse(r.head, at_end=False)
        if not res:
            return
        call = res[0]
        if call.name and self._policy.announces(call.name) and self._room():
            call_id = call.id or self._make_id()
            r.announced = DispatchedCall(self._next_index, call_id, call.name, "")
            self._next_index += 1
            self._events.append(ToolCallStart(r.announced.index, r.announced.id, call.name))

    def _parse(self, text: str, at_end: bool) -> RegionParse | None:
        try:
            res = self._fmt.parse_region(text, at_end)
        except Exception:  # a format's bug must not take the response down
            logger.exception("tool format %s failed to parse a region", type(self._fmt).__name__)
            return None
        if res is None or isinstance(res, RegionParse):
            return res
        return RegionParse(res)

    def _close(self, end: int, hit: MarkerHit | None = None) -> None:
        r, s = self._region, self._s
        text = "".join(r.parts) + s[r.start : end] if r.parts else s[r.start : end]
        res = self._parse(text, at_end=True)
        self._region = None
        if res is None:
            if r.announced is not None:
                logger.warning("tool call %s was announced but its region parsed to nothing",
                               r.announced.name)
                self._record(r.announced.index, r.announced.id, r.announced.name, "{}")
            # Not a call: the opener is the answer's, and the rest is read again as text.
            self._content(r.opener)
            self._resume(text, len(r.opener), end, _TEXT, r)
            self._remember_closer(text, len(r.opener), hit)
            return
        start = min(max(res.start, 0), len(text))
        stop = len(text) if res.end is None else res.end
        stop = min(max(stop, start + 1 if start else len(r.opener)), len(text))
        self._content(text[:start])
        self._dispatch(res, r.announced)
        self._resume(text, stop, end, _AFTER, r)

    def _resume(self, text: str, offset: int, end: int, mode: str, r: Region) -> None:
        """Carry on from ``text[offset:]`` (the region's unconsumed bytes), then ``s[end:]``."""
        self._mode = mode
        if not r.parts:  # text is s[r.start:end]: no copy
            self._pos = r.start + offset
        else:
            self._s = text[offset:] + self._s[end:]
            self._pos = 0
            self._known_closer = None

    def _remember_closer(self, text: str, offset: int, hit: MarkerHit | None) -> None:
        """After a region that was not a call: where its closer was (or that none came
        before the end), so that a region opened inside it does not search those bytes
        again. Without this an answer quoting an opener k times costs k passes over the rest."""
        if hit is None:
            self._known_closer = (self._pos, None)
        else:
            at = self._pos + len(text) - len(hit.marker) - offset
            self._known_closer = (self._pos, MarkerHit(at, hit.marker))

    def _dispatch(self, calls: list[ToolCall], announced: DispatchedCall | None) -> None:
        for i, call in enumerate(calls):
            if not call.name or not self._policy.dispatches(call.name):
                self.suppressed += 1
                continue
            if announced is not None and i == 0 and call.name == announced.name:
                index, cid = announced.index, announced.id
                announced = None
            elif not self._room():
                self.suppressed += 1
                continue
            else:
                index, cid = self._next_index, call.id or self._make_id()
                self._next_index += 1
                self._events.append(ToolCallStart(index, cid, call.name))
            args = coerce_arguments(call.arguments or {}, self._policy.schema(call.name))
            self._record(index, cid, call.name, json.dumps(args, ensure_ascii=False))
        if announced is not None:
            logger.warning("tool call %s was announced but parsed differently", announced.name)
            self._record(announced.index, announced.id, announced.name, "{}")

    def _room(self) -> bool:
        """Whether another call may be dispatched (one only without parallel calls)."""
        return self._policy.parallel or self._next_index == 0

    def _record(self, index: int, cid: str, name: str, arguments: str) -> None:
        self._events.append(ToolCallArguments(index, arguments))
        self.calls.append(DispatchedCall(index, cid, name, arguments))
