"""Which tool-call format a model emits, resolved once at start-up, never from output.

``--tool-call-parser auto`` renders the chat template with a tools payload and a
tool-call turn (``chat_encoders.render_probe_prompt``) and tries each registered format's
``matches_template`` in detection order (DETECT_PRIORITY, then name). When none matches,
tool calls are delivered as plain text and the start-up log says so. An explicit name is
checked here, before any weights load; an unknown one is a ConfigError that suggests
the nearest known name.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass

from atom_core.errors import ConfigError
from atom_core.parsing.tool_format import ToolFormat

logger = logging.getLogger(__name__)

# Formats ATOM recognises and does not read: named in the log so that "tool calls arrive
# as text" is not a mystery.
UNSUPPORTED_FORMATS: dict[str, tuple[str, ...]] = {
    "harmony": ("<|start|>", "<|channel|>", "<|message|>"),
}


@dataclass(frozen=True)
class FormatChoice:
    """The resolved format (None: tool calls are text) and why, for the start-up log."""

    name: str | None
    format: ToolFormat | None
    reason: str


def _registry():
    from atom_core.plugins import get_registries

    return get_registries().tool_formats


def format_classes(registry=None) -> list[tuple[str, type[ToolFormat]]]:
    """Registered formats in detection order (DETECT_PRIORITY, then name)."""
    reg = registry if registry is not None else _registry()
    entries = [(e.name, e.obj) for e in reg.entries()]
    return sorted(entries, key=lambda e: (-getattr(e[1], "DETECT_PRIORITY", 0), e[0]))


def check_tool_call_parser(name: str, registry=None) -> None:
    """Refuse an unknown ``--tool-call-parser`` name (call before loading weights)."""
    resolve_tool_format(name, None, registry)


def resolve_tool_format(name: str, probe: str | None, registry=None) -> FormatChoice:
    """``name`` (``auto``, ``none``, or a registered format); ``probe`` is the chat
    template rendered by ``render_probe_prompt`` (None when there is no template)."""
    reg = registry if registry is not None else _registry()
    if name == "none":
        return FormatChoice(
            None, None, "disabled by --tool-call-parser none; tool calls arrive as text"
        )
    if name != "auto":
        if name not in reg:
            known = [*reg.names(), "auto", "none"]
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown tool-call parser {name!r}{hint}; known: "
                              f"{', '.join(known)}")
        return FormatChoice(name, reg.get(name)(), "named by --tool-call-parser")
    if not probe:
        return FormatChoice(None, None, "no chat template to read; tool calls arrive as text")
    for fname, cls in format_classes(reg):
        fmt = cls()
        if fmt.matches_template(probe):
            return FormatChoice(fname, fmt, "detected in the chat template")
    for uname, signature in UNSUPPORTED_FORMATS.items():
        if all(s in probe for s in signature):
            return FormatChoice(
                None, None,
                f"the chat template uses the {uname} format, which ATOM does not read; "
                "tool calls arrive as text",
            )
    return FormatChoice(
        None, None,
        "the chat template shows no known tool-call format; tool calls arrive as text",
    )
