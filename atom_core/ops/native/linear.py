"""The ``linear`` op's reference: cuBLAS / the CPU BLAS."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def promote(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x in fp32 where the weight is fp32 (the MoE router keeps an fp32 weight and takes the
    model-dtype hidden states); any other mismatch is left for F.linear to refuse."""
    return x.float() if weight.dtype == torch.float32 else x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, an fp32 weight promoting x (``promote``)."""
    return F.linear(promote(x, weight), weight, bias)
