"""ATOM: an LLM inference engine and OpenAI-compatible server, built from plugins."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("atom-core")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
