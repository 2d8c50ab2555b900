"""Mistral's tool-call format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

from __future__ import annotations

import json
from typing import Any

from atom_core.hookspecs import hookimpl
from atom_core.parsing import RegionParse, ToolCall, ToolFormat

MARKER = "[TOOL_CALLS]"


class MistralToolFormat(ToolFormat):
    name = "mistral"
    START_MARKERS = (MARKER,)
    TEMPLATE_SIGNATURE = ("[AVAILABLE_TOOLS]", MARKER)

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        body = len(text) - len(text[len(MARKER) :].lstrip())
        try:
            calls, end = json.JSONDecoder().raw_decode(text, body)
        except json.JSONDecodeError:
            return None  # not a call yet (or never): the core decides by at_end
        if isinstance(calls, dict):
            calls = [calls]
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
        ):
            return None
        # The markup ends with the JSON; what follows is the answer's, handed back as content.
        parsed = [ToolCall(c["name"], dict(c.get("arguments") or {})) for c in calls]
        return RegionParse(parsed, end=end)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return MARKER + json.dumps([{"name": name, "arguments": arguments}])


@hookimpl
def register_tool_formats(register):
    register("mistral", MistralToolFormat)
