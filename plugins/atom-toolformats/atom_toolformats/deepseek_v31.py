"""DeepSeek-V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}``
``<｜tool▁call▁end｜><｜tool▁calls▁end｜>``.

The call's own closer is ``<｜tool▁call▁end｜>``; the next call opens with
``<｜tool▁call▁begin｜>`` and ``<｜tool▁calls▁end｜>`` is the wrapper's. The name is
legible at ``<｜tool▁sep｜>``, before the arguments.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import RegionParse, ToolCall, ToolFormat
from atom_core.parsing.call_grammar import json_item, repeat, rule_name, seq
from atom_toolformats._syntax import NAME_WINDOW, json_arguments, read_json, skip_ws, valid_name

CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class DeepSeekV31Format(ToolFormat):
    name = "deepseek_v31"
    START_MARKERS = (CALLS, CALL)
    CALL_SELF_CLOSERS = (CALL_END,)
    WRAPPER_CLOSERS = (CALLS_END,)
    # V3/R1 write "function<｜tool▁sep｜>NAME\n```json": the JSON right after the separator
    # is V3.1's.
    TEMPLATE_SIGNATURE = (CALLS, SEP + "{")
    DETECT_PRIORITY = 10

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        i = skip_ws(text, len(CALLS)) if text.startswith(CALLS) else 0
        if not text.startswith(CALL, i):
            return None
        sep = text.find(SEP, i + len(CALL), i + len(CALL) + NAME_WINDOW)
        if sep < 0:
            return None  # the name is still arriving (or was cut: not a call)
        name = text[i + len(CALL) : sep].strip()
        if not valid_name(name):
            return None
        j = skip_ws(text, sep + len(SEP))
        read = read_json(text, j, at_end) if j < len(text) else None
        if read is None:
            return RegionParse([ToolCall(name, {} if at_end else None)]) if j >= len(text) else None
        value, end, complete = read
        if not complete and not at_end:
            return RegionParse([ToolCall(name)])
        args = json_arguments(value)
        if args is None:
            return None
        k = skip_ws(text, end)
        stop = k + len(CALL_END) if text.startswith(CALL_END, k) else end
        return RegionParse([ToolCall(name, args)], 0, stop)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f"{CALLS}{CALL}{name}{SEP}{args}{CALL_END}{CALLS_END}"

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        fns = [f"{rule_name('fn', i)}: {seq(CALL + name + SEP, special=special)} "
               f"{json_item(schema)} {seq(CALL_END, special=special)}"
               for i, (name, schema) in enumerate(functions.items())]
        alternatives = " | ".join(rule_name("fn", i) for i in range(len(functions)))
        return (f"calls: {seq(CALLS, special=special)} {repeat('call', parallel)} "
                f"{seq(CALLS_END, special=special)}\ncall: {alternatives}\n"
                + "\n".join(fns) + "\n")
