"""Runs from the repository root and from a copy of this folder alike: this folder goes on
``sys.path`` so the tests import ``tiny_gptoss`` by plain name, whatever pytest's import
mode."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    # The repository's pytest configuration declares it too; a copy of this folder has none.
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
