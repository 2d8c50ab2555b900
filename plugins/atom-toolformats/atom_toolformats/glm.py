"""GLM-4.5: ``<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>``.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The name runs to the first newline or ``<arg_key>``; it is legible before the arguments.
``</tool_call>`` is the call's own closer and ends an unfinished value. Values are text
(the template writes non-strings as JSON); the request's schema types them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import RegionParse, ToolCall, ToolFormat
from atom_core.parsing.call_grammar import properties, repeat, rule_name, seq, value_rule
from atom_toolformats._syntax import NAME_WINDOW, first_of, render_value, valid_name

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE, VALUE_CLOSE = "<arg_value>", "</arg_value>"


def read_pairs(body: str) -> dict[str, Any]:
    args: dict[str, Any] = {}
    i = body.find(KEY)
    while i >= 0:
        k_end = body.find(KEY_CLOSE, i + len(KEY))
        if k_end < 0:
            break
        key = body[i + len(KEY) : k_end].strip()
        v = body.find(VALUE, k_end + len(KEY_CLOSE))
        if v < 0:
            break
        j, _ = first_of(body, (VALUE_CLOSE, KEY), v + len(VALUE))
        if key:
            args[key] = body[v + len(VALUE) : j if j >= 0 else len(body)]
        if j < 0:
            break
        i = body.find(KEY, j)
    return args


class GlmFormat(ToolFormat):
    name = "glm"
    START_MARKERS = (OPEN,)
    CALL_SELF_CLOSERS = (CLOSE,)
    TEMPLATE_SIGNATURE = (OPEN, KEY)
    DETECT_PRIORITY = 10

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        start = len(OPEN)
        j, _ = first_of(text, ("\n", KEY, CLOSE), start, start + NAME_WINDOW)
        if j < 0 and (not at_end or len(text) > start + NAME_WINDOW):
            return None  # the name may still be arriving, or this is not a call
        name = text[start : j if j >= 0 else len(text)].strip()
        if not valid_name(name):
            return None
        close = text.find(CLOSE, start)
        if close < 0 and not at_end:
            return RegionParse([ToolCall(name)])
        body_end = close if close >= 0 else len(text)
        stop = close + len(CLOSE) if close >= 0 else len(text)
        return RegionParse([ToolCall(name, read_pairs(text[start:body_end]))], 0, stop)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        pairs = "".join(
            f"{KEY}{k}{KEY_CLOSE}\n{VALUE}{render_value(v)}{VALUE_CLOSE}\n"
            for k, v in arguments.items()
        )
        return f"{OPEN}{name}\n{pairs}{CLOSE}"

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        stops = (VALUE_CLOSE, KEY, CLOSE)  # where the reader ends a value
        rules = []
        fns = []
        for i, (name, schema) in enumerate(functions.items()):
            items = []
            for j, (key, sub, required) in enumerate(properties(schema)):
                value, rule = value_rule(rule_name(f"v{i}", j), sub, stops,
                                         VALUE_CLOSE + "\n", special)
                rules.append(rule)
                item = f"{seq(f'{KEY}{key}{KEY_CLOSE}{chr(10)}{VALUE}', special=special)} {value}"
                items.append(item if required else f"({item})?")
            fns.append(rule_name("fn", i))
            rules.append(f"{rule_name('fn', i)}: {seq(OPEN + name + chr(10), special=special)} "
                         f"{' '.join(items)} {seq(CLOSE, special=special)}")
        return (f"calls: {repeat('call', parallel, seq(chr(10), special=special))}\n"
                f"call: {' | '.join(fns)}\n" + "\n".join(rules) + "\n")
