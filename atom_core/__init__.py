"""ATOM: an LLM inference engine and OpenAI-compatible server, built from plugins.

In-process use: ``from atom_core import LLMEngine, SamplingParams`` (README.md, "From Python").
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atom_core.engine.llm_engine import LLMEngine
    from atom_core.sampling_params import SamplingParams

try:
    __version__ = metadata.version("atom-core")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["LLMEngine", "SamplingParams", "__version__"]

# Loaded on first use: every module (plugins, hookspecs, ...) imports this package first,
# and the engine imports torch, the loader and the plugins.
_LAZY = {
    "LLMEngine": "atom_core.engine.llm_engine",
    "SamplingParams": "atom_core.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
