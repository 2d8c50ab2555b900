"""Mistral's tool-call format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

from __future__ import annotations

import json
from typing import Any

from atom_core.entrypoints.openai.tool_parser.base import ToolCall, ToolFormat
from atom_core.hookspecs import hookimpl

MARKER = "[TOOL_CALLS]"


class MistralToolFormat(ToolFormat):
    name = "mistral"
    START_MARKERS = (MARKER,)
    TEMPLATE_SIGNATURE = ("[AVAILABLE_TOOLS]", MARKER)

    def parse_region(self, text: str, at_end: bool) -> list[ToolCall] | None:
        body = text[len(MARKER) :].lstrip()
        try:
            calls, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return None  # not a call yet (or never): the core decides by at_end
        if isinstance(calls, dict):
            calls = [calls]
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
        ):
            return None
        return [ToolCall(c["name"], dict(c.get("arguments") or {})) for c in calls]

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return MARKER + json.dumps([{"name": name, "arguments": arguments}])


@hookimpl
def register_tool_formats(register):
    register("mistral", MistralToolFormat)
