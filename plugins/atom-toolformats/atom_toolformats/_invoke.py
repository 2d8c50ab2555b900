"""The ``<invoke name="X"><parameter name="p">v</parameter></invoke>`` shape that MiniMax-M2
and DeepSeek's DSML share (DSML prefixes each tag with ``｜DSML｜``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from atom_core.parsing import ToolCall
from atom_core.parsing.call_grammar import (
    is_text,
    properties,
    repeat,
    rule_name,
    seq,
    value_rule,
)
from atom_toolformats._syntax import read_attrs, valid_name


@dataclass(frozen=True)
class InvokeTags:
    invoke: str  # "<invoke"
    invoke_close: str  # "</invoke>"
    param: str  # "<parameter"
    param_close: str  # "</parameter>"

    @property
    def invoke_marker(self) -> str:
        return self.invoke + " name="


@dataclass
class Invoke:
    """One invoke read from a region: the call (arguments None while still arriving),
    where its markup ends, and its body (between the tags)."""

    call: ToolCall
    stop: int
    body: str


def read_invoke(text: str, i: int, tags: InvokeTags, at_end: bool) -> Invoke | None:
    """The invoke starting at ``text[i]``; None when it is not one, or its name is still
    arriving (a name cut by the end of the stream is not a call)."""
    if not text.startswith(tags.invoke_marker, i):
        return None
    head = read_attrs(text, i + len(tags.invoke))
    if head is None:
        return None
    attrs, body_start, self_closing = head
    name = attrs.get("name", "")
    if not valid_name(name):
        return None
    if self_closing:  # <invoke name="x"/>: a call with no arguments
        return Invoke(ToolCall(name, {}), body_start, "")
    close = text.find(tags.invoke_close, body_start)
    if close < 0 and not at_end:
        return Invoke(ToolCall(name), len(text), "")
    body_end = close if close >= 0 else len(text)
    stop = close + len(tags.invoke_close) if close >= 0 else len(text)
    return Invoke(ToolCall(name, {}), stop, text[body_start:body_end])


def read_params(body: str, tags: InvokeTags) -> list[tuple[dict[str, str], str]]:
    """The body's ``<parameter name="k" ...>v</parameter>`` entries as (attributes, value);
    a value cut short keeps what was written."""
    out: list[tuple[dict[str, str], str]] = []
    marker = tags.param + " name="
    i = body.find(marker)
    while i >= 0:
        head = read_attrs(body, i + len(tags.param))
        if head is None:
            break
        attrs, v, _ = head
        j = body.find(tags.param_close, v)
        out.append((attrs, body[v : j if j >= 0 else len(body)]))
        if j < 0:
            break
        i = body.find(marker, j + len(tags.param_close))
    return out


def invoke_rules(tags: InvokeTags, wrap: tuple[str, str],
                 functions: Mapping[str, Mapping[str, Any] | None], parallel: bool,
                 special: Collection[str], typed: bool = False) -> str:
    """``ToolFormat.call_rules`` for the invoke shape inside its ``wrap`` (opener, closer),
    one invoke a line; ``typed`` writes DSML's ``string="true"|"false"`` attribute."""
    stops = (tags.param_close, tags.invoke_close)  # where the reader ends a value
    rules = []
    for i, (name, schema) in enumerate(functions.items()):
        items = []
        for j, (key, sub, required) in enumerate(properties(schema)):
            value, rule = value_rule(rule_name(f"v{i}", j), sub, stops,
                                     tags.param_close + "\n", special)
            rules.append(rule)
            kind = f' string="{str(is_text(sub)).lower()}"' if typed else ""
            head = tags.param + ' name="' + key + '"' + kind + ">"
            item = f"{seq(head, special=special)} {value}"
            items.append(item if required else f"({item})?")
        head = tags.invoke_marker + '"' + name + '">\n'
        rules.append(f"{rule_name('fn', i)}: {seq(head, special=special)} "
                     f"{' '.join(items)} {seq(tags.invoke_close, special=special)}")
    alternatives = " | ".join(rule_name("fn", i) for i in range(len(functions)))
    nl = seq("\n", special=special)
    return (f"calls: {seq(wrap[0] + chr(10), special=special)} "
            f"{repeat('call', parallel, nl)} {seq(chr(10) + wrap[1], special=special)}\n"
            f"call: {alternatives}\n" + "\n".join(rules) + "\n")
