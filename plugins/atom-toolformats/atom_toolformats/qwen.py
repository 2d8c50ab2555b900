"""Qwen3-Coder's XML:
``<tool_call><function=NAME><parameter=P>…</parameter></function></tool_call>``.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A region closes on ``</function>``, the call's own closer, which also ends an unfinished
parameter value; ``</tool_call>`` is only the wrapper's (dropped right after a call). A
bare ``<function=`` opens a region too, for a model that leaves the wrapper out. Values
are text; the request's schema types them (``"3"`` -> 3 for an integer).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import RegionParse, ToolCall, ToolFormat
from atom_core.parsing.call_grammar import (
    properties,
    repeat,
    rule_name,
    seq,
    value_rule,
)
from atom_toolformats._syntax import (
    NAME_WINDOW,
    first_of,
    render_value,
    skip_ws,
    trim_one_newline,
    valid_name,
)

OPEN, WRAP_CLOSE = "<tool_call>", "</tool_call>"
FN, FN_CLOSE = "<function=", "</function>"
PARAM, PARAM_CLOSE = "<parameter=", "</parameter>"


def read_parameters(body: str) -> dict[str, Any]:
    """``<parameter=k>v</parameter>`` pairs; a value also ends at the next ``<parameter=``
    or the end of the body (a call cut short keeps what was written)."""
    args: dict[str, Any] = {}
    i = body.find(PARAM)
    while i >= 0:
        gt = body.find(">", i + len(PARAM))
        if gt < 0:
            break
        key = body[i + len(PARAM) : gt].strip()
        j, which = first_of(body, (PARAM_CLOSE, PARAM), gt + 1)
        value_end = j if j >= 0 else len(body)
        if key:
            args[key] = trim_one_newline(body[gt + 1 : value_end])
        if j < 0:
            break
        i = body.find(PARAM, j + len(which) if which == PARAM_CLOSE else j)
    return args


class QwenCoderFormat(ToolFormat):
    name = "qwen"
    START_MARKERS = (OPEN, FN)
    CALL_SELF_CLOSERS = (FN_CLOSE,)
    WRAPPER_CLOSERS = (WRAP_CLOSE,)
    TEMPLATE_SIGNATURE = (OPEN, FN)
    DETECT_PRIORITY = 10

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        i = skip_ws(text, len(OPEN)) if text.startswith(OPEN) else 0
        if not text.startswith(FN, i):
            return None
        gt = text.find(">", i + len(FN), i + len(FN) + NAME_WINDOW)
        if gt < 0:
            return None  # the name is still arriving, or was cut: not a call
        name = text[i + len(FN) : gt].strip()
        if not valid_name(name):
            return None
        close = text.find(FN_CLOSE, gt + 1)
        if close < 0 and not at_end:
            return RegionParse([ToolCall(name)])  # named; arguments still arriving
        body_end = close if close >= 0 else len(text)
        stop = close + len(FN_CLOSE) if close >= 0 else len(text)
        return RegionParse([ToolCall(name, read_parameters(text[gt + 1 : body_end]))], 0, stop)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        params = "".join(
            f"<parameter={k}>\n{render_value(v)}\n</parameter>\n" for k, v in arguments.items()
        )
        return f"{OPEN}\n{FN}{name}>\n{params}{FN_CLOSE}\n{WRAP_CLOSE}"

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        # A text value may hold none of the markers the reader stops a value at.
        stops = (PARAM_CLOSE, PARAM, FN_CLOSE)
        rules = [f"calls: {repeat('call', parallel, seq(chr(10), special=special))}",
                 "call: " + seq(OPEN + "\n", special=special) + " ("
                 + " | ".join(rule_name("fn", i) for i in range(len(functions))) + ") "
                 + seq("\n" + WRAP_CLOSE, special=special)]
        for i, (name, schema) in enumerate(functions.items()):
            items = []
            for j, (key, sub, required) in enumerate(properties(schema)):
                value, rule = value_rule(rule_name(f"v{i}", j), sub, stops,
                                         f"\n{PARAM_CLOSE}\n", special)
                rules.append(rule)
                item = f"{seq(f'{PARAM}{key}>{chr(10)}', special=special)} {value}"
                items.append(item if required else f"({item})?")
            rules.append(f"{rule_name('fn', i)}: {seq(f'{FN}{name}>{chr(10)}', special=special)} "
                         f"{' '.join(items)} {seq(FN_CLOSE, special=special)}")
        return "\n".join(rules) + "\n"
