"""Hermes: a JSON object inside ``<tool_call>…</tool_call>`` (Qwen3's default).

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The call's own closer is the wrapper, since a JSON object has none of its own. The name
is legible once its string closes, so a call in progress is named early.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import PartialStr, RegionParse, ToolCall, ToolFormat
from atom_core.parsing.call_grammar import ANY_OBJECT, json_item, repeat, seq
from atom_toolformats._syntax import json_arguments, read_json, skip_ws, valid_name

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesFormat(ToolFormat):
    name = "hermes"
    START_MARKERS = (OPEN,)
    CALL_SELF_CLOSERS = (CLOSE,)
    TEMPLATE_SIGNATURE = (OPEN, '"name"')

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        i = skip_ws(text, len(OPEN))
        if not text.startswith("{", i):
            return None
        read = read_json(text, i, at_end)
        if read is None or not isinstance(read[0], dict):
            return None
        obj, end, complete = read
        name = obj.get("name")
        if not isinstance(name, str) or isinstance(name, PartialStr) or not valid_name(name):
            return None  # no name, or one still arriving (or cut): not a call
        if not complete and not at_end:
            return RegionParse([ToolCall(name)])
        args = json_arguments(obj.get("arguments", obj.get("parameters")))
        if args is None:
            return None
        j = skip_ws(text, end)
        stop = j + len(CLOSE) if text.startswith(CLOSE, j) else end
        return RegionParse([ToolCall(name, args)], 0, stop)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{OPEN}\n{body}\n{CLOSE}"

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        objects = [
            {"type": "object",
             "properties": {"name": {"const": name}, "arguments": schema or ANY_OBJECT},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name, schema in functions.items()
        ]
        body = objects[0] if len(objects) == 1 else {"anyOf": objects}
        return (f"calls: {repeat('call', parallel, seq(chr(10), special=special))}\n"
                f"call: {seq(OPEN + chr(10), special=special)} {json_item(body)} "
                f"{seq(chr(10) + CLOSE, special=special)}\n")
