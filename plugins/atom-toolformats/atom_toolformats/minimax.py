"""MiniMax-M2: ``<minimax:tool_call><invoke name="X"><parameter name="p">v</parameter>``
``</invoke></minimax:tool_call>``.

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

A region closes on ``</invoke>`` (the call's own closer; it also ends an unfinished
value), so text after a call streams; a second ``<invoke`` opens the next region and
``</minimax:tool_call>`` is the wrapper's, dropped right after a call. Values are text
(the template writes non-strings as JSON); the request's schema types them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import RegionParse, ToolFormat
from atom_toolformats._invoke import InvokeTags, invoke_rules, read_invoke, read_params
from atom_toolformats._syntax import render_value, skip_ws

WRAP, WRAP_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
TAGS = InvokeTags("<invoke", "</invoke>", "<parameter", "</parameter>")


class MiniMaxFormat(ToolFormat):
    name = "minimax"
    START_MARKERS = (WRAP, TAGS.invoke_marker)
    CALL_SELF_CLOSERS = (TAGS.invoke_close,)
    WRAPPER_CLOSERS = (WRAP_CLOSE,)
    TEMPLATE_SIGNATURE = (WRAP, TAGS.invoke_marker)
    DETECT_PRIORITY = 10

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        i = skip_ws(text, len(WRAP)) if text.startswith(WRAP) else 0
        inv = read_invoke(text, i, TAGS, at_end)
        if inv is None:
            return None
        if inv.call.arguments is not None:
            params = read_params(inv.body, TAGS)
            inv.call.arguments = {a["name"]: v for a, v in params if a.get("name")}
        return RegionParse([inv.call], 0, inv.stop)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        params = "".join(
            f'{TAGS.param} name="{k}">{render_value(v)}{TAGS.param_close}\n'
            for k, v in arguments.items()
        )
        return f'{WRAP}\n{TAGS.invoke_marker}"{name}">\n{params}{TAGS.invoke_close}\n{WRAP_CLOSE}'

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        return invoke_rules(TAGS, (WRAP, WRAP_CLOSE), functions, parallel, special)
