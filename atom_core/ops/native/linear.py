"""The ``linear`` op's reference: cuBLAS / the CPU BLAS."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with x promoted to weight's dtype (the MoE router keeps an fp32 weight
    and takes the model-dtype hidden states)."""
    return F.linear(x.to(weight.dtype), weight, bias)
