"""The sampler's reduction over the vocabulary."""

from __future__ import annotations

import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value ([B, V] -> [B] int64): the first one among equals,
    and a NaN counts as larger than every number (the first NaN wins), as torch.argmax."""
    return x.argmax(dim=-1)
