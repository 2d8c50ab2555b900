"""A pre-norm block's residual add and RMSNorm, finished by the ops around them.

At decode sizes the norm between two sublayers is a kernel of its own whose cost is its
round trips, not its arithmetic: it waits for the projection before it, reads the rows,
writes them, and the projection after it waits again. Here the kernel that produces the
sublayer's output (a split-K reduce, the MoE's pairs' sum) also adds the residual and
writes, beside h = x + residual, ``h * weight`` and its column blocks' sums of h * h. The
ops that read the normed rows multiply by ``h * weight`` and scale each row of their
product by 1/rms(h) at the end, by linearity: W (h * g / rms(h)) = (W (h * g)) / rms(h).
The norm's kernel drops out of the step.

The rounding moves as in ``rms_norm_linear``: the norm rounds h * g / rms(h) to the model
dtype, this rounds h * g; both are one rounding of each element of the product's input.

Producers take an ``AddNorm`` (``linear(..., add_norm=)``, ``fused_moe(..., add_norm=)``)
and return a ``DeferredNorm`` where their kernel can finish it, else their plain output,
to which the caller adds the residual and applies the norm as before. The ``linear``,
``moe_route`` and ``fused_moe`` ops accept a ``DeferredNorm`` where they take x; an
implementation that cannot use it takes ``normed(d, rms_norm)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from atom_core.quant.fp8 import Fp8Weight


class AddNorm(NamedTuple):
    """What a sublayer's last op is asked to finish: rms_norm(out + residual).

    ``reader`` is the weight of the projection that will read the normed rows, where that
    is a ``linear`` op; None where the readers always take a ``DeferredNorm`` (the MoE's
    router and experts). A producer declines where the reader would have to norm the rows
    itself anyway (cuBLAS serves it): that costs the reader a norm kernel and saves none."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    reader: torch.Tensor | Fp8Weight | None = None


class DeferredNorm(NamedTuple):
    """rms_norm(summed, weight, eps), not yet divided by the rows' rms."""

    summed: torch.Tensor  # [T, H] h = x + residual, the residual stream's next value
    scaled: torch.Tensor  # [T, H] h * weight, rounded to h's dtype
    sumsq: torch.Tensor  # [S, T] fp32: S column blocks' sums of h * h, added in order
    weight: torch.Tensor  # [H]
    eps: float


def normed(
    d: DeferredNorm, rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
) -> torch.Tensor:
    """The norm's output itself, from ``rms_norm`` over h (the unfused op's bits)."""
    return rms_norm(d.summed, d.weight, d.eps)

