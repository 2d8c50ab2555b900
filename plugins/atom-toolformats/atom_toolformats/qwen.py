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

from typing import Any

from atom_core.parsing import RegionParse, ToolCall, ToolFormat
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
