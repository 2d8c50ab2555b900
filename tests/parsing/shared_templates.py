"""The vendors' chat templates the tests read: tests/data/chat_templates/ (SOURCES.md there
says where each came from), found from this file rather than the working directory."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


def template_path(name: str) -> Path:
    """The template's file; a name not in the repository is an error, never a skip."""
    path = TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(f"no vendor chat template {name!r} in {TEMPLATES}")
    return path
