"""Named fused ops; the implementation for each is chosen per device from the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from atom_core.plugins import get_registries


def device_kind(device: torch.device | str) -> str:
    """'cpu', 'cuda' or 'hip' (ROCm builds of torch report CUDA devices)."""
    device = torch.device(device)
    if device.type == "cuda":
        return "hip" if getattr(torch.version, "hip", None) else "cuda"
    return device.type


def resolve_op(name: str, device: torch.device | str) -> Callable[..., Any]:
    """The function implementing op ``name`` on ``device`` (highest priority wins)."""
    return get_registries().ops.resolve(name, device_kind(device)).fn
