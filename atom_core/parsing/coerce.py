"""Typing argument values by the request's JSON schema.

XML-shaped formats (Qwen-Coder, GLM, MiniMax, DSML's ``string="true"``) carry every value
as text, so ``<parameter=days>3</parameter>`` reads as ``"3"``. The request's schema says
what ``days`` is; a value is converted only when the schema asks for a non-string type
and the text is a valid spelling of it, and is otherwise left as written. Without a
schema nothing is guessed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

_INT = re.compile(r"-?\d+")


def _types(schema: Mapping[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            if isinstance(sub, Mapping):
                out.extend(_types(sub))
    return out


def coerce_value(text: str, schema: Mapping[str, Any]) -> Any:
    """``text`` as the schema's type, or unchanged when it is a string type or no spelling fits."""
    types = _types(schema)
    if not types or "string" in types:
        return text
    s = text.strip()
    for t in types:
        if t == "integer" and _INT.fullmatch(s):
            return int(s)
        if t == "number":
            try:
                num = json.loads(s)
            except ValueError:
                continue
            if isinstance(num, (int, float)) and not isinstance(num, bool):
                return num
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t == "null" and s.lower() in ("null", "none"):
            return None
        if t in ("object", "array"):
            try:
                val = json.loads(s)
            except ValueError:
                continue
            if isinstance(val, dict if t == "object" else list):
                return val
    return text


def coerce_arguments(
    arguments: Mapping[str, Any], schema: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Every string value whose property schema asks for another type, converted."""
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(props, Mapping):
        return dict(arguments)
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        sub = props.get(key)
        typed = isinstance(value, str) and isinstance(sub, Mapping)
        out[key] = coerce_value(value, sub) if typed else value
    return out
