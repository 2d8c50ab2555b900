"""Triton kernels for CUDA/ROCm GPUs, registered above the native ops (priority 10).

Every kernel here also runs on CPU tensors under ``TRITON_INTERPRET=1`` (tests/ops), so it
is checked against its native reference without a GPU.
"""

from __future__ import annotations

import importlib.util


def triton_importable() -> bool:
    """True when the triton package is installed (it is not a core dependency)."""
    return importlib.util.find_spec("triton") is not None
