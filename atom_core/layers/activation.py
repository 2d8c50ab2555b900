"""Gated activations, calling the registry's silu_and_mul op."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.layers.context import get_build_context
from atom_core.ops import resolve_op


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2d (the gate_up output)."""

    def __init__(self) -> None:
        super().__init__()
        self._op = resolve_op("silu_and_mul", get_build_context().device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)
