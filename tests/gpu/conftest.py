"""tests/gpu: skipped without a CUDA device (and without triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "needs a CUDA device"
    elif importlib.util.find_spec("triton") is None:
        reason = "needs triton"
    if reason is None:
        return
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))
