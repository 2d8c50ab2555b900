"""Kimi-K3: channel framing around every answer, and one channel per tool call.

    <|open|>response<|sep|>Checking.<|close|>response<|sep|>
    <|open|>call<|sep|>get_weather<|sep|>{"city": "Paris"}<|close|>call<|sep|><|end_of_msg|>

Of the declared markers only the call opener hands the stream over; the response
framing is dropped where it stands, so an answer streams. A call is read only once its
``<|close|>call<|sep|>`` has arrived (so on a long payload the name comes with the
arguments); at the end of the stream a cut call's JSON is closed. The token spelling is
assumed (kimi_k3_tokens.py).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from atom_core.parsing import ReasoningDialect, RegionParse, ToolCall, ToolFormat
from atom_core.parsing.call_grammar import json_item, repeat, rule_name, seq
from atom_toolformats import kimi_k3_tokens as tok
from atom_toolformats._syntax import NAME_WINDOW, json_arguments, read_json, skip_ws, valid_name


class KimiK3Format(ToolFormat):
    name = "kimi_k3"
    START_MARKERS = (tok.CALL_OPEN, *tok.RESPONSE_FRAMING)
    CALL_SELF_CLOSERS = (tok.CALL_CLOSE,)
    TEMPLATE_SIGNATURE = (tok.CALL_OPEN,)
    DETECT_PRIORITY = 10

    def opens_region(self, marker: str) -> bool:
        return marker == tok.CALL_OPEN

    def parse_region(self, text: str, at_end: bool) -> RegionParse | None:
        start = len(tok.CALL_OPEN)
        sep = text.find(tok.SEP, start, start + NAME_WINDOW)
        name = text[start:sep].strip() if sep >= 0 else ""
        if not valid_name(name):
            return None
        close = text.find(tok.CALL_CLOSE, sep)
        if close < 0 and not at_end:
            return None  # a call is invisible until it closes
        body_end = close if close >= 0 else len(text)
        j = skip_ws(text, sep + len(tok.SEP))
        body = text[j:body_end].rstrip()
        read = read_json(body, 0, True) if body else ({}, 0, True)
        args = json_arguments(read[0]) if read is not None else None
        if args is None:
            return None
        end = close + len(tok.CALL_CLOSE) if close >= 0 else len(text)
        return RegionParse([ToolCall(name, args)], 0, end)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f"{tok.CALL_OPEN}{name}{tok.SEP}{args}{tok.CALL_CLOSE}"

    def call_rules(self, functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                   special: Collection[str] = frozenset()) -> str:
        # One channel per call, back to back. The message's <|end_of_msg|> is not the
        # grammar's: the sequence ends once the calls are complete.
        fns = [f"{rule_name('fn', i)}: {seq(tok.CALL_OPEN + name + tok.SEP, special=special)} "
               f"{json_item(schema)} {seq(tok.CALL_CLOSE, special=special)}"
               for i, (name, schema) in enumerate(functions.items())]
        alternatives = " | ".join(rule_name("fn", i) for i in range(len(functions)))
        return (f"calls: {repeat('call', parallel)}\ncall: {alternatives}\n"
                + "\n".join(fns) + "\n")


class KimiK3Dialect(ReasoningDialect):
    name = "kimi_k3"
    START_MARKERS = tok.REASONING_START
    END_MARKERS = tok.REASONING_END
    TEMPLATE_SIGNATURE = tok.REASONING_START
    DETECT_PRIORITY = 10
