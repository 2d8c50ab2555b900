"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.ops.deferred_norm import AddNorm
from atom_core.ops.native.linear import plain_linear
from atom_core.quant.fp8 import Fp8Weight


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of last dimension 2d."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_linear(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    *,
    add_norm: AddNorm | None = None,
) -> torch.Tensor:
    """The gated MLP's activation and down projection: ``linear(silu_and_mul(x), weight,
    bias)`` for x of last dimension 2K and weight [N, K]; ``add_norm`` declined, as
    ``linear`` declines it."""
    return plain_linear(silu_and_mul(x), weight, bias)
