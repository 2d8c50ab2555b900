"""Reading a JSON value that may have been cut off (a call truncated by max_tokens).

``parse_json_prefix`` closes what is open: an unterminated string keeps what was written
(as a ``PartialStr``, so a caller can tell a finished string from a cut one), a key with no
value is dropped, a cut literal or number is dropped unless it is already a number. The
result serialises to valid JSON, which is the point: a client never accumulates an
object it cannot parse.
"""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBERISH = re.compile(r"-?\d*(?:\.\d*)?(?:[eE][-+]?\d*)?")
_CUT_UNICODE = re.compile(r"(?<!\\)((?:\\\\)*)\\u[0-9a-fA-F]{0,3}$")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_WS = " \t\n\r"


class PartialStr(str):
    """A string value whose closing quote never arrived."""


class _Cut(Exception):
    """The text ended inside a value that cannot be completed."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def ws(self) -> None:
        s, i = self.s, self.i
        while i < len(s) and s[i] in _WS:
            i += 1
        self.i = i

    def value(self) -> Any:
        self.ws()
        if self.i >= len(self.s):
            raise _Cut
        c = self.s[self.i]
        if c == "{":
            return self.obj()
        if c == "[":
            return self.arr()
        if c == '"':
            return self.string()
        return self.scalar()

    def obj(self) -> dict[str, Any]:
        self.i += 1
        out: dict[str, Any] = {}
        while True:
            self.ws()
            if self.i >= len(self.s):
                return out
            c = self.s[self.i]
            if c == "}":
                self.i += 1
                return out
            if c == ",":
                self.i += 1
                continue
            if c != '"':
                raise ValueError(f"expected a key at {self.i}")
            key = self.string()
            if isinstance(key, PartialStr):
                return out
            self.ws()
            if self.i >= len(self.s):
                return out
            if self.s[self.i] != ":":
                raise ValueError(f"expected ':' at {self.i}")
            self.i += 1
            try:
                out[key] = self.value()
            except _Cut:
                return out

    def arr(self) -> list[Any]:
        self.i += 1
        out: list[Any] = []
        while True:
            self.ws()
            if self.i >= len(self.s):
                return out
            c = self.s[self.i]
            if c == "]":
                self.i += 1
                return out
            if c == ",":
                self.i += 1
                continue
            try:
                out.append(self.value())
            except _Cut:
                return out

    def string(self) -> str:
        m = _STRING.match(self.s, self.i)
        if m is not None:
            self.i = m.end()
            return json.loads(m.group())
        # Cut: drop a dangling escape, then decode what was written.
        body = _CUT_UNICODE.sub(r"\1", self.s[self.i + 1 :])
        if (len(body) - len(body.rstrip("\\"))) % 2:
            body = body[:-1]
        self.i = len(self.s)
        try:
            return PartialStr(json.loads('"' + body + '"'))
        except json.JSONDecodeError:
            return PartialStr(body)

    def scalar(self) -> Any:
        s, i = self.s, self.i
        for word, val in (("true", True), ("false", False), ("null", None)):
            if s.startswith(word, i):
                self.i = i + len(word)
                return val
            if word.startswith(s[i:]):
                raise _Cut
        m = _NUMBERISH.match(s, i)
        if m is None or not m.group():
            raise ValueError(f"unexpected {s[i]!r} at {i}")
        self.i = m.end()
        text = m.group()
        if self.i == len(s):  # cut inside a number: keep its longest valid prefix
            valid = _NUMBER.match(text)
            if valid is None:
                raise _Cut
            text = valid.group()
        elif _NUMBER.fullmatch(text) is None:
            raise ValueError(f"bad number {text!r} at {i}")
        return json.loads(text)


def parse_json_prefix(text: str) -> tuple[Any, int]:
    """The value a (possibly cut) JSON text starts with, and where it ended.

    Raises ValueError when the text is not JSON even as a prefix.
    """
    r = _Reader(text)
    try:
        value = r.value()
    except _Cut:
        raise ValueError("no value before the text ends") from None
    return value, r.i
