"""Small pieces of syntax the formats share: names, whitespace, JSON bodies, tag values."""

from __future__ import annotations

import json
import re
from typing import Any

from atom_core.parsing import PartialStr, parse_json_prefix

NAME = re.compile(r"\w[\w.\-:]{0,127}")
# How far past a name's start its terminator may be. Searching no further keeps a region
# that is not a call (an answer quoting an opener) cheap to reject, however long it is.
NAME_WINDOW = 160
TAG_WINDOW = 512
_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def valid_name(name: str) -> bool:
    return NAME.fullmatch(name) is not None


def read_json(text: str, i: int, at_end: bool) -> tuple[Any, int, bool] | None:
    """The JSON value at ``text[i]``: (value, end, complete). A cut value counts only
    ``at_end`` or as far as its finished parts go (the caller decides); None when the
    text is not JSON even as a prefix."""
    try:
        value, end = json.JSONDecoder().raw_decode(text, i)
        return value, end, True
    except json.JSONDecodeError:
        pass
    try:
        value, end = parse_json_prefix(text[i:])
    except ValueError:
        return None
    return value, i + end, False


def json_arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: a JSON object, or a string holding one (double-encoded)."""
    if value is None:
        return {}
    if isinstance(value, str) and not isinstance(value, PartialStr):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return dict(value) if isinstance(value, dict) else None


def first_of(
    text: str, needles: tuple[str, ...], start: int, end: int | None = None
) -> tuple[int, str]:
    """The earliest of ``needles`` in ``text[start:end]``: (index, needle), or (-1, "")."""
    best, which = -1, ""
    for n in needles:
        j = text.find(n, start, end if end is not None else len(text))
        if j >= 0 and (best < 0 or j < best):
            best, which = j, n
    return best, which


def trim_one_newline(value: str) -> str:
    """A tag value without the one newline the templates put on each side of it."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def render_value(value: Any) -> str:
    """How the templates write an argument value inside a tag: strings as is, else JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def read_name_attr(text: str, i: int, limit: int | None = None) -> tuple[str, int] | None:
    """A ``name=`` attribute's value starting at ``text[i]`` (quoted or bare), and where it
    ends; None while it is still arriving (or when it does not end before ``limit``)."""
    limit = min(len(text), limit if limit is not None else i + TAG_WINDOW)
    if i >= limit:
        return None
    if text[i] in "\"'":
        j = text.find(text[i], i + 1, limit)
        return None if j < 0 else (text[i + 1 : j], j + 1)
    j = i
    while j < limit and text[j] not in " \t\r\n/>":
        j += 1
    return None if j >= limit else (text[i:j], j)


def read_attrs(text: str, i: int) -> tuple[dict[str, str], int, bool] | None:
    """``k="v"`` attributes from ``text[i]`` up to the tag's ``>``: (attributes, index after
    the tag, self-closing); None while the tag is still arriving or is not a tag (one
    longer than TAG_WINDOW is not)."""
    attrs: dict[str, str] = {}
    limit = min(len(text), i + TAG_WINDOW)
    while True:
        i = skip_ws(text, i)
        if i >= limit:
            return None
        if text.startswith("/>", i):
            return attrs, i + 2, True
        if text[i] == ">":
            return attrs, i + 1, False
        eq = text.find("=", i, limit)
        if eq < 0:
            return None
        key = text[i:eq].strip()
        if not key or any(c in key for c in " <>\"'"):
            return None
        val = read_name_attr(text, eq + 1, limit)
        if val is None:
            return None
        attrs[key], i = val
