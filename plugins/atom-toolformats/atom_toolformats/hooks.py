"""Registers the tool-call formats and reasoning dialects of this package."""

from __future__ import annotations

from atom_core.hookspecs import hookimpl
from atom_toolformats.deepseek_v31 import DeepSeekV31Format
from atom_toolformats.dsml import DsmlFormat
from atom_toolformats.glm import GlmFormat
from atom_toolformats.harmony import HarmonyDialect, HarmonyFormat
from atom_toolformats.hermes import HermesFormat
from atom_toolformats.kimi import KimiK2Format
from atom_toolformats.kimi_k3 import KimiK3Dialect, KimiK3Format
from atom_toolformats.minimax import MiniMaxFormat
from atom_toolformats.qwen import QwenCoderFormat
from atom_toolformats.think import ThinkDialect

FORMATS = (
    HermesFormat,
    QwenCoderFormat,
    GlmFormat,
    KimiK2Format,
    KimiK3Format,
    MiniMaxFormat,
    DsmlFormat,
    DeepSeekV31Format,
    HarmonyFormat,
)
DIALECTS = (ThinkDialect, KimiK3Dialect, HarmonyDialect)


@hookimpl
def register_tool_formats(register):
    for cls in FORMATS:
        register(cls.name, cls)


@hookimpl
def register_reasoning_dialects(register):
    for cls in DIALECTS:
        register(cls.name, cls)
