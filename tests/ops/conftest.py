"""Triton kernels on CPU: run them through the interpreter (set before triton.jit runs)."""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("triton") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
