"""The ``linear`` op's reference: cuBLAS / the CPU BLAS."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_core.ops.deferred_norm import AddNorm, DeferredNorm, normed
from atom_core.ops.native.norm import rms_norm


def rows_of(x: torch.Tensor | DeferredNorm) -> torch.Tensor:
    """x itself, or a ``DeferredNorm``'s normed rows: the reference finishes the norm."""
    return normed(x, rms_norm) if isinstance(x, DeferredNorm) else x


def promote(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x in fp32 where the weight is fp32 (the MoE router keeps an fp32 weight and takes the
    model-dtype hidden states); any other mismatch is left for F.linear to refuse."""
    return x.float() if weight.dtype == torch.float32 else x


def linear(
    x: torch.Tensor | DeferredNorm, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    add_norm: AddNorm | None = None,
) -> torch.Tensor:
    """``F.linear``, an fp32 weight promoting x (``promote``). The reference never defers a
    norm: ``add_norm`` is declined (the caller adds and norms), a ``DeferredNorm`` x normed."""
    x = rows_of(x)
    return F.linear(promote(x, weight), weight, bias)
