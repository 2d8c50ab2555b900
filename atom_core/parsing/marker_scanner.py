"""MarkerScanner: the one rule for how much of a stream is safe to release.

Two stages read the model's text for markers (the reasoning channel's delimiters and a
tool-call format's tags), and neither may hand out a byte that could turn out to be the
first character of one. Both ask this class: release everything except the longest
suffix of the buffer that is a prefix of some marker. The wait is bounded by the longest
marker, and is zero for a chunk whose tail cannot begin one.

The scanner is stateless over the text it is given; a caller keeps its own buffer and a
position in it, and passes only bytes it has not yet released (the held tail is shorter
than the longest marker), so a stream costs time linear in its length.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MarkerHit:
    """A whole marker found at ``start`` in the scanned text."""

    start: int
    marker: str

    @property
    def end(self) -> int:
        return self.start + len(self.marker)


def _alternation(strings: Iterable[str]) -> str:
    # Longest first, so that at one position the longest marker wins.
    return "|".join(re.escape(s) for s in sorted(set(strings), key=lambda s: (-len(s), s)))


class MarkerScanner:
    """Finds whole markers in a stream and says how much of it may be released."""

    def __init__(self, markers: Iterable[str]) -> None:
        longest_first = sorted({m for m in markers if m}, key=lambda s: (-len(s), s))
        self.markers: tuple[str, ...] = tuple(longest_first)
        self.longest: int = max((len(m) for m in self.markers), default=0)
        self._find = re.compile(_alternation(self.markers)) if self.markers else None
        prefixes = {m[:i] for m in self.markers for i in range(1, len(m))}
        # A suffix of the text that is a proper prefix of a marker: the leftmost one that
        # reaches the end of the text is the longest.
        self._tail = re.compile(f"(?:{_alternation(prefixes)})\\Z") if prefixes else None

    def safe_end(self, text: str, pos: int = 0) -> int:
        """How far ``text[pos:]`` may be released: up to the longest suffix that could
        still become a marker. Only the last ``longest - 1`` characters are examined."""
        if self._tail is None:
            return len(text)
        m = self._tail.search(text, max(pos, len(text) - self.longest + 1))
        return m.start() if m else len(text)

    def find(self, text: str, pos: int = 0, at_end: bool = False) -> MarkerHit | None:
        """The first marker in ``text[pos:]`` that is decided, or None.

        A whole marker is not yet decided while a longer one could still start at or
        before it (``<a`` vs ``<ab>``, or a marker inside another's prefix): the bytes
        that follow pick, so it waits for them unless ``at_end``. When None is returned,
        ``safe_end`` says what may be released.
        """
        if self._find is None:
            return None
        m = self._find.search(text, pos)
        if m is None:
            return None
        if not at_end and self.safe_end(text, pos) <= m.start():
            return None
        return MarkerHit(m.start(), m.group())

    def match(self, text: str, pos: int, at_end: bool = False) -> MarkerHit | None | bool:
        """Whether a marker starts exactly at ``pos``: the hit; True when ``text[pos:]``
        could still become one (wait for more); False when it cannot."""
        if self._find is None:
            return False
        if pos >= len(text):
            return not at_end
        m = self._find.match(text, pos)
        undecided = not at_end and self.safe_end(text, pos) == pos
        if undecided:
            return True
        if m is not None:
            return MarkerHit(pos, m.group())
        return False
