"""Reasoning-channel dialects (the contract plugins subclass) and ``resolve_dialect``.

A dialect is the channel's delimiters. Which one a model speaks is decided once, at
start-up, from the chat template's source (what the template does with a reply); it is
never guessed per response. Whether a given response *begins* inside the channel is a
per-request fact, read from that request's rendered prompt (``prompt_opens_channel``).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import ClassVar

from atom_core.errors import ConfigError

logger = logging.getLogger(__name__)

# Used when the template names no dialect: inline <think>…</think> is a no-op for a model
# that never writes the tag, and right for one that does without saying so.
FALLBACK_DIALECT = "think"


class ReasoningDialect:
    """A reasoning channel's delimiters.

    START_MARKERS      open the channel (``<think>``); dropped from the output.
    END_MARKERS        close it (``</think>``); dropped from the output.
    TEMPLATE_SIGNATURE substrings that, all present in the chat template's source,
                       identify this dialect.
    DETECT_PRIORITY    higher is tried first (a more specific signature).
    """

    name: ClassVar[str] = ""
    START_MARKERS: ClassVar[tuple[str, ...]] = ()
    END_MARKERS: ClassVar[tuple[str, ...]] = ()
    TEMPLATE_SIGNATURE: ClassVar[tuple[str, ...]] = ()
    DETECT_PRIORITY: ClassVar[int] = 0

    def matches_template(self, source: str) -> bool:
        return bool(self.TEMPLATE_SIGNATURE) and all(s in source for s in self.TEMPLATE_SIGNATURE)

    def prompt_opens_channel(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves the channel open for the model's first token
        (DeepSeek-R1's template ends its generation prompt with ``<think>\\n``)."""
        return prompt.rstrip().endswith(self.START_MARKERS) if self.START_MARKERS else False


@dataclass(frozen=True)
class DialectChoice:
    """The resolved dialect (None: the template names none) and why, for the start-up log."""

    name: str | None
    dialect: ReasoningDialect | None
    reason: str


def _registry():
    from atom_core.plugins import get_registries

    return get_registries().reasoning_dialects


def dialect_classes(registry=None) -> list[tuple[str, type[ReasoningDialect]]]:
    """Registered dialects in detection order (priority, then name)."""
    reg = registry if registry is not None else _registry()
    entries = [(e.name, e.obj) for e in reg.entries()]
    return sorted(entries, key=lambda e: (-getattr(e[1], "DETECT_PRIORITY", 0), e[0]))


def resolve_dialect(
    template_source: str | None, name: str = "auto", registry=None
) -> DialectChoice:
    """The dialect to use: ``name`` if given (``none`` disables), else detected from the
    chat template's source. An unknown name raises ConfigError, suggesting the nearest."""
    reg = registry if registry is not None else _registry()
    if name == "none":
        return DialectChoice(None, None, "disabled by --reasoning-dialect none")
    if name != "auto":
        if name not in reg:
            known = [*reg.names(), "auto", "none"]
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown reasoning parser {name!r}{hint}; known: "
                              f"{', '.join(known)}")
        return DialectChoice(name, reg.get(name)(), "named by --reasoning-dialect")
    if not template_source:
        return DialectChoice(None, None, "no chat template")
    for dname, cls in dialect_classes(reg):
        dialect = cls()
        if dialect.matches_template(template_source):
            return DialectChoice(dname, dialect, "detected in the chat template")
    return DialectChoice(None, None, "the chat template names no reasoning dialect")


def with_fallback(choice: DialectChoice, registry=None) -> DialectChoice:
    """``choice``, or the inline-<think> fallback when auto-detection found nothing."""
    if choice.dialect is not None or choice.reason.startswith("disabled"):
        return choice
    reg = registry if registry is not None else _registry()
    if FALLBACK_DIALECT not in reg:
        return choice
    return DialectChoice(
        FALLBACK_DIALECT, reg.get(FALLBACK_DIALECT)(),
        f"{choice.reason}; falling back to inline {FALLBACK_DIALECT!r}",
    )
