"""Runs from the repository root and from a copy of this folder alike.

Without a GPU, Triton kernels run only through its interpreter, and ``triton.jit`` reads the
switch when a kernel module is imported: it is set here, before any test imports one. This
folder goes on ``sys.path`` so tests import ``triton_reference`` and one another's helpers
by plain name, whatever pytest's import mode.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    # The repository's pytest configuration declares them too; a copy of this folder has none.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
