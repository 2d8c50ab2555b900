"""Where the vendors' chat templates are: ``shared/`` beside the repository (CI keeps a copy
there), found from this file rather than the working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = REPO_ROOT.parent / "shared" / "chat_templates"


def template_path(name: str) -> Path:
    path = TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"vendor chat templates not found at {TEMPLATES} "
                    "(expected shared/ beside the repository)")
    return path
