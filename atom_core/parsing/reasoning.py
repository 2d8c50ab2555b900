"""Splitting the reasoning channel from the answer.

``ReasoningChannel`` carries the model's dialect and whether this request's output
begins inside the channel, and has one accessor per delivery mode: ``splitter()`` for a
stream, ``split(text)`` for a whole response. ``split`` is the splitter fed once, so the
two cannot disagree.

The channel opens on any start marker and closes on any end marker, wherever they stand
(a model that answers, thinks, and answers again is read the same in both modes), and
nothing else is touched: no stripping, so ``</think>\\n\\nThe answer.`` gives content
``"\\n\\nThe answer."`` at every chunk size. A stray end marker outside the channel is
ordinary text. Text inside the channel goes out as reasoning as it arrives; the only
bytes held are a possible marker prefix (MarkerScanner).
"""

from __future__ import annotations

from atom_core.parsing.events import ContentDelta, Event, ReasoningDelta
from atom_core.parsing.marker_scanner import MarkerScanner
from atom_core.parsing.reasoning_dialects import ReasoningDialect


class ReasoningSplitter:
    """Per request: feed text deltas, get ReasoningDelta / ContentDelta; ``finish()`` at end."""

    def __init__(self, dialect: ReasoningDialect | None, starts_inside: bool = False) -> None:
        self._open = MarkerScanner(dialect.START_MARKERS if dialect else ())
        self._close = MarkerScanner(dialect.END_MARKERS if dialect else ())
        self.inside = dialect is not None and starts_inside
        self._held = ""

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def longest_marker(self) -> int:
        return max(self._open.longest, self._close.longest)

    def feed(self, text: str) -> list[Event]:
        return self._run(text, at_end=False)

    def finish(self) -> list[Event]:
        return self._run("", at_end=True)

    def _run(self, delta: str, at_end: bool) -> list[Event]:
        s, self._held = self._held + delta, ""
        out: list[Event] = []
        pos = 0
        while True:
            scanner = self._close if self.inside else self._open
            kind = ReasoningDelta if self.inside else ContentDelta
            hit = scanner.find(s, pos, at_end)
            end = hit.start if hit is not None else (len(s) if at_end else scanner.safe_end(s, pos))
            if end > pos:
                out.append(kind(s[pos:end]))
            if hit is None:
                self._held = s[end:]
                return out
            pos = hit.end
            self.inside = not self.inside


class ReasoningChannel:
    """The dialect and whether the output begins inside the channel, for one request."""

    def __init__(self, dialect: ReasoningDialect | None, starts_inside: bool = False) -> None:
        self.dialect = dialect
        self.starts_inside = dialect is not None and starts_inside

    @classmethod
    def for_prompt(cls, dialect: ReasoningDialect | None, prompt: str) -> ReasoningChannel:
        """Whether the rendered prompt left the channel open decides where output begins."""
        return cls(dialect, dialect is not None and dialect.prompt_opens_channel(prompt))

    def splitter(self) -> ReasoningSplitter:
        """Streaming accessor."""
        return ReasoningSplitter(self.dialect, self.starts_inside)

    def split(self, text: str) -> tuple[str, str]:
        """Non-streaming accessor: (reasoning, content) of a whole response."""
        sp = self.splitter()
        events = sp.feed(text) + sp.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        return reasoning, content
