"""DeepSeek-V3.2/V4 DSML: ``<｜DSML｜function_calls><｜DSML｜invoke name="X">…</｜DSML｜invoke>…``.

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="false"`` values are JSON; ``string="true"`` ones text. A region closes on
``</｜DSML｜invoke>``; a bare ``<｜DSML｜invoke`` (no wrapper) opens one too, and an
invoke whose body is a JSON object takes it as the arguments (the direct-JSON branch,
which needs the whole object: its name is legible early, its arguments are not).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import RegionParse, ToolFormat, parse_json_prefix
from atom_toolformats._invoke import InvokeTags, invoke_rules, read_invoke, read_params
from atom_toolformats._syntax import json_arguments, read_json, skip_ws

T = "｜DSML｜"
WRAP, WRAP_CLOSE = f"<{T}function_calls>", f"</{T}function_calls>"
TAGS = InvokeTags(f"<{T}invoke", f"</{T}invoke>", f"<{T}parameter", f"</{T}parameter>")


def json_value(text: str) -> Any:
    """A ``string="false"`` value: JSON, a cut JSON's prefix, or the text as written."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return parse_json_prefix(text.strip())[0]
    except ValueError:
        return text


class DsmlFormat(ToolFormat):
    name = "dsml"
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
        if inv.call.arguments is None:
            return RegionParse([inv.call])
        j = skip_ws(inv.body, 0)
        if inv.body.startswith("{", j):  # direct-JSON body
            read = read_json(inv.body, j, at_end)
            args = json_arguments(read[0]) if read is not None else None
            if args is None:
                return None
            inv.call.arguments = args
        else:
            args = {}
            for attrs, value in read_params(inv.body, TAGS):
                if attrs.get("name"):
                    as_json = attrs.get("string") == "false"
                    args[attrs["name"]] = json_value(value) if as_json else value
            inv.call.arguments = args
        return RegionParse([inv.call], 0, inv.stop)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        params = "".join(
            f'{TAGS.param} name="{k}" string="true">{v}{TAGS.param_close}\n'
            if isinstance(v, str)
            else f'{TAGS.param} name="{k}" string="false">'
            f"{json.dumps(v, ensure_ascii=False)}{TAGS.param_close}\n"
            for k, v in arguments.items()
        )
        return f'{WRAP}\n{TAGS.invoke_marker}"{name}">\n{params}{TAGS.invoke_close}\n{WRAP_CLOSE}'

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        return invoke_rules(TAGS, (WRAP, WRAP_CLOSE), functions, parallel, special, typed=True)
