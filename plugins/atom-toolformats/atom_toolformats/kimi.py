"""Kimi-K2: a section of calls, each ``functions.NAME:IDX`` with JSON arguments.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The region is the whole section (REGION_END_MARKERS), since one section holds several
calls. An entry counts only once its ``<|tool_call_end|>`` has arrived, so a call whose
arguments are still arriving is not named early (a short one, inside the head, is).
At the end of the stream a cut entry's JSON is closed, so it is still valid. The id the
model wrote (``functions.get_weather:0``) is the call's id.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import RegionParse, ToolCall, ToolFormat
from atom_core.parsing.call_grammar import MAX_PARALLEL_CALLS, json_item, seq
from atom_toolformats._syntax import json_arguments, read_json, skip_ws, valid_name

SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
# The singular spelling, which K2 models also write.
SECTION_ALT, SECTION_END_ALT = "<|tool_call_section_begin|>", "<|tool_call_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def name_of(call_id: str) -> str:
    """``functions.get_weather:0`` -> ``get_weather``."""
    name = call_id.split(":", 1)[0]
    return name[len("functions.") :] if name.startswith("functions.") else name


class KimiK2Format(ToolFormat):
    name = "kimi"
    START_MARKERS = (SECTION, SECTION_ALT)
    REGION_END_MARKERS = (SECTION_END, SECTION_END_ALT)
    TEMPLATE_SIGNATURE = (SECTION, ARGS)
    DETECT_PRIORITY = 10

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        opener = SECTION if text.startswith(SECTION) else SECTION_ALT
        calls: list[ToolCall] = []
        i = skip_ws(text, len(opener))
        stop = i
        while text.startswith(CALL, i):
            a = text.find(ARGS, i + len(CALL))
            e = text.find(CALL_END, i + len(CALL))
            if e < 0 and not at_end:
                break  # an entry is invisible until it ends
            if a < 0 and at_end and e < 0 and calls:
                return RegionParse(calls, 0, len(text))  # an entry cut before its arguments
            if a < 0 or (0 <= e < a):
                return None
            call_id = text[i + len(CALL) : a].strip()
            if not valid_name(name_of(call_id)):
                return None
            body_end = e if e >= 0 else len(text)
            for end_marker in (SECTION_END, SECTION_END_ALT):
                cut = text.find(end_marker, a, body_end)
                body_end = cut if cut >= 0 else body_end
            body = text[a + len(ARGS) : body_end].strip()
            read = read_json(body, 0, True) if body else ({}, 0, True)
            args = json_arguments(read[0]) if read is not None else None
            if args is None:
                return None
            calls.append(ToolCall(name_of(call_id), args, id=call_id))
            if e < 0:
                return RegionParse(calls, 0, len(text))
            i = stop = skip_ws(text, e + len(CALL_END))
        for end_marker in (SECTION_END, SECTION_END_ALT):
            if text.startswith(end_marker, i):
                return RegionParse(calls, 0, i + len(end_marker))
        return RegionParse(calls, 0, stop) if calls else None

    def render_call(self, name: str, arguments: dict[str, Any], index: int = 0) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f"{SECTION}{CALL}functions.{name}:{index}{ARGS}{args}{CALL_END}{SECTION_END}"

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        # Each call's id counts from 0 (``functions.f:0``, ``functions.g:1``), as the model
        # writes them: clients key calls by id.
        count = MAX_PARALLEL_CALLS if parallel else 1
        rules = []
        for k in range(count):
            entries = " | ".join(
                f"{seq(f'functions.{name}:{k}', ARGS, special=special)} {json_item(schema)}"
                for name, schema in functions.items())
            rules.append(f"call_{k}: {seq(CALL, special=special)} ({entries}) "
                         f"{seq(CALL_END, special=special)}")
        chain = ""
        for k in reversed(range(1, count)):
            chain = f"(call_{k} {chain})?"
        return (f"calls: {seq(SECTION, special=special)} call_0 {chain} "
                f"{seq(SECTION_END, special=special)}\n" + "\n".join(rules) + "\n")
