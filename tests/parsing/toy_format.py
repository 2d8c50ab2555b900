"""A toy tool-call format for the core's tests (the real ones live in atom-toolformats).

    <call>NAME {"json": "arguments"}</call>

``[[frame]]`` is framing (dropped), ``</calls>`` a wrapper closer. The name is legible
once a space follows it.
"""

from __future__ import annotations

import json
from typing import Any

from atom_core.parsing.partial_json import parse_json_prefix
from atom_core.parsing.tool_format import RegionParse, ToolCall, ToolFormat

OPEN, CLOSE = "<call>", "</call>"


class ToyFormat(ToolFormat):
    name = "toy"
    START_MARKERS = (OPEN, "[[frame]]")
    CALL_SELF_CLOSERS = (CLOSE,)
    WRAPPER_CLOSERS = ("</calls>",)
    TEMPLATE_SIGNATURE = (OPEN,)

    def opens_region(self, marker: str) -> bool:
        return marker == OPEN

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        sp = text.find(" ", len(OPEN))
        if sp < 0:
            return None
        name = text[len(OPEN) : sp]
        if not name.isidentifier():
            return None
        close = text.find(CLOSE, sp)
        if close < 0 and not at_end:
            return RegionParse([ToolCall(name)])
        body = text[sp + 1 : close if close >= 0 else len(text)]
        try:
            args, _ = parse_json_prefix(body)
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        end = close + len(CLOSE) if close >= 0 else len(text)
        return RegionParse([ToolCall(name, args)], 0, end)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return f"{OPEN}{name} {json.dumps(arguments)}{CLOSE}"
