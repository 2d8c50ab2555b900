"""The plugin is discovered and registers its formats and dialects."""

from __future__ import annotations

from atom_core.plugins import get_registries


def test_registers_formats_and_dialects():
    reg = get_registries()
    assert {"hermes", "qwen", "glm", "harmony"} <= set(reg.tool_formats.names())
    assert {"think", "harmony"} <= set(reg.reasoning_dialects.names())
