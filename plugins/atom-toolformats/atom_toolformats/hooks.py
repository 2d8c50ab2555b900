"""Registers the tool-call formats and reasoning dialects of this package."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl
from atom_toolformats.glm import GlmFormat
from atom_toolformats.hermes import HermesFormat
from atom_toolformats.qwen import QwenCoderFormat
from atom_toolformats.think import ThinkDialect

FORMATS = (HermesFormat, QwenCoderFormat, GlmFormat)
DIALECTS = (ThinkDialect,)


@hookimpl
def register_tool_formats(register):
    for cls in FORMATS:
        register(cls.name, cls)


@hookimpl
def register_reasoning_dialects(register):
    for cls in DIALECTS:
        register(cls.name, cls)
